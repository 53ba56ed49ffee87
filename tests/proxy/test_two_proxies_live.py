"""Two proxies in front of one fleet (real servers, NIXL): the servers register with both
(`--register A B`), each proxy routes on its own view, and the proxy holds nothing that
cannot be rebuilt. A proxy killed mid-stream loses that stream (its client sees the
connection break: documented) and the client's retry through the other proxy gets the
same answer; the servers free what the lost stream held; the killed proxy, restarted on
its port, learns the fleet again from the next renewals."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import httpx
import pytest

from launch import http_client
from launch.ports import free_port
from tests.support.pd_client import complete, stream
from tests.support.server_harness import running_proxy, running_server, wait_until

pytestmark = pytest.mark.slow
KEY = "admin-key-of-the-test"
LEASE_S = 3.0
BODY = {"prompt": "The keeper of the lighthouse wrote down every ship. ", "max_tokens": 8, "temperature": 0,
        "ignore_eos": True}
LONG = BODY | {"max_tokens": 400, "stream": True}


def listed(front) -> set[str]:
    response = http_client().get(f"{front.url}/admin/instances", headers={"Authorization": f"Bearer {KEY}"},
                                 timeout=10)
    return {i["url"] for i in response.json()["instances"]} if response.status_code == 200 else set()


def test_two_proxies_serve_one_fleet_and_a_client_of_a_killed_one_retries_on_the_other(tiny_models, tmp_path) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    a_port = free_port()
    with contextlib.ExitStack() as stack:
        proxy = lambda name, **kw: stack.enter_context(running_proxy(  # noqa: E731
            tmp_path / f"{name}.log", "--admin-key", KEY, "--probe-interval", "1", "--breaker-cooldown", "1", **kw))
        a, b = proxy("a", port=a_port), proxy("b")
        joining = ("--register", a.url, b.url, "--register-lease", str(LEASE_S))
        p = stack.enter_context(running_server(tiny_models["qwen3"], tmp_path / "p.log", "--role", "prefill",
                                               *joining))
        d = stack.enter_context(running_server(tiny_models["qwen3"], tmp_path / "d.log", "--role", "decode",
                                               *joining))
        assert wait_until(lambda: listed(a) == listed(b) == {p.url, d.url}, 30)
        reference = complete(d, BODY).token_ids  # served alone (colocated)
        for front in (a, b):
            assert complete(front, BODY).token_ids == stream(front, BODY).token_ids == reference

        with http_client().stream("POST", f"{a.url}/v1/completions", json=LONG, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            a.process.send_signal(signal.SIGKILL)  # mid-stream: a proxy this test started
            a.process.wait(30)
            with pytest.raises(httpx.HTTPError):  # the stream through the dead proxy is lost
                for _ in lines:
                    pass
        assert complete(b, BODY).token_ids == reference  # the client's retry, on the other proxy
        assert d.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0  # the lost stream was aborted on D
        assert p.wait_for_metric("pd_kv_requests_held", lambda v: v == 0) == 0

        started = time.monotonic()
        with running_proxy(tmp_path / "a-again.log", "--admin-key", KEY, "--probe-interval", "1",
                           port=a_port) as again:  # nothing to restore: renewals rebuild its fleet
            assert wait_until(lambda: listed(again) == {p.url, d.url}, 2 * LEASE_S)
            assert time.monotonic() - started < 2 * LEASE_S + 10
            assert complete(again, BODY).token_ids == stream(again, BODY).token_ids == reference
