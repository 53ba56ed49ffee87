"""A prefill server that dies after it answered a request's KV parameters, before the
decode server read them, behind the proxy (real servers and NIXL): D's read fails, and
its --kv-load-failure-policy decides: `recompute` computes the prompt on D and the
client gets the same tokens as if nothing had happened; `fail` ends the request with the
documented error (502 kv_load_failed, or that error event in a stream). Either way D
holds no KV after and serves on. (A prefill server dying *during* prefill: the request
goes to another P, tests/proxy/test_proxy_failover_live.py.)

The window between P's answer and D's read is held open by D's queue: D runs one
sequence at a time (--max-num-seqs 1) and is busy with a long request, so the request
prefilled meanwhile waits in D's queue, its blocks on P unread, while P is killed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from launch import http_client
from tests.support.proxy_fakes import wait_until
from tests.support.server_harness import running_proxy, running_server

pytestmark = pytest.mark.slow
BODY = {"prompt": "The keeper of the lighthouse wrote in the log that night", "max_tokens": 12, "temperature": 0,
        "ignore_eos": True}
LONG = {"prompt": "A long watch:", "max_tokens": 400, "temperature": 0, "ignore_eos": True}


def answer(front, body: dict):
    return http_client().post(f"{front.url}/v1/completions", json=body, timeout=120)


def streamed_events(front, body: dict) -> list[str]:
    with http_client().stream("POST", f"{front.url}/v1/completions", json=body | {"stream": True},
                              timeout=120) as response:
        assert response.status_code == 200, response.read()
        return [line for line in response.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_prefill_server_dying_before_its_kv_is_read_is_recovered_by_the_load_failure_policy(
        tiny_models, tmp_path, colocated, policy) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    expected = colocated["qwen3"]
    reference = http_client().post(f"{expected.url}/v1/completions", json=BODY, timeout=120).json()
    with contextlib.ExitStack() as stack:
        start = lambda name, *args: stack.enter_context(  # noqa: E731
            running_server(tiny_models["qwen3"], tmp_path / f"{name}.log", *args))
        p = start("p", "--role", "prefill")
        d = start("d", "--role", "decode", "--max-num-seqs", "1", "--kv-load-failure-policy", policy)
        front = stack.enter_context(running_proxy(tmp_path / "proxy.log", "--prefill", p.url, "--decode", d.url,
                                                  "--probe-interval", "3600"))
        with ThreadPoolExecutor(3) as pool:
            busy = pool.submit(answer, front, LONG)
            assert wait_until(lambda: d.metrics()["pd_num_requests_running"] == 1, 60)
            waiting = [pool.submit(answer, front, BODY), pool.submit(streamed_events, front, BODY)]
            assert wait_until(lambda: d.metrics()["pd_num_requests_waiting"] == 2, 60), "both wait in D's queue"
            p.process.send_signal(signal.SIGKILL)  # a server this test started: its blocks are gone unread
            p.process.wait(30)
            assert busy.result().status_code == 200
            whole, events = (f.result() for f in waiting)
        if policy == "recompute":
            assert whole.status_code == 200 and whole.json()["choices"][0]["text"] == reference["choices"][0]["text"]
            text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events if e.startswith("data: {"))
            assert text == reference["choices"][0]["text"] and events[-1] == "data: [DONE]"
        else:
            assert whole.status_code == 502 and whole.json()["error"]["code"] == "kv_load_failed", whole.text
            error = json.loads(events[-2][6:])["error"]
            assert error["code"] == "kv_load_failed" and "could not be loaded" in error["message"]
        assert d.metrics()[f'pd_kv_load_failures_total{{policy="{policy}"}}'] == 2
        assert d.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0
        assert d.health().status_code == 200
