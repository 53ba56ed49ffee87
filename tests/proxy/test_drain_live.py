"""`pd serve` drains on SIGTERM (pd/server/drain.py): a prefill server keeps the blocks a
decode server has yet to read and serves that read, refuses new requests with 503
server_draining, tells the proxy it registered with, and exits once nothing is left (or
its drain's time is over). A decode server stopped mid-stream finishes the stream, and
requests through the proxy meanwhile go to the other decode server; nothing fails."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from launch import http_client
from tests.support.pd_client import complete, prefill, stream
from tests.support.server_harness import running_proxy, running_server, wait_until

pytestmark = pytest.mark.slow
BODY = {"prompt": "The keeper of the lighthouse wrote down every ship. ", "max_tokens": 8, "temperature": 0,
        "ignore_eos": True}
LONG = BODY | {"max_tokens": 96}


def members(front) -> dict[str, dict]:
    response = http_client().get(f"{front.url}/admin/instances", headers={"Authorization": "Bearer k"}, timeout=10)
    return {i["url"]: i for i in response.json()["instances"]}


@pytest.fixture(scope="module")
def model(tiny_models):
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    return tiny_models["qwen3"]


def test_a_prefill_server_stopped_keeps_its_blocks_until_they_are_read(model, tmp_path) -> None:
    with contextlib.ExitStack() as stack:
        front = stack.enter_context(running_proxy(tmp_path / "proxy.log", "--admin-key", "k"))
        joining = ("--register", front.url, "--register-lease", "3")
        p = stack.enter_context(running_server(model, tmp_path / "p.log", "--role", "prefill", *joining,
                                               "--drain-timeout", "60", "--kv-lease-seconds", "60"))
        d = stack.enter_context(running_server(model, tmp_path / "d.log", "--role", "decode", *joining))
        assert wait_until(lambda: len(members(front)) == 2, 30)
        reference = complete(front, BODY).token_ids
        params = prefill(p, BODY).body["kv_transfer_params"]  # P keeps the blocks for a D

        p.process.send_signal(signal.SIGTERM)
        assert wait_until(lambda: members(front)[p.url]["draining"], 10)  # it told the proxy at once
        time.sleep(1.0)
        assert p.process.poll() is None  # still there: its blocks wait for their reader
        assert p.health().json()["draining"] is True
        refused = http_client().post(f"{p.url}/v1/completions", json=BODY, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_draining"
        through = http_client().post(f"{front.url}/v1/completions", json=BODY, timeout=30)  # no P to take it
        assert through.status_code == 503

        assert complete(d, BODY | {"kv_transfer_params": params}).token_ids == reference  # read from draining P
        assert p.process.wait(15) == 0  # then it exits, by itself
        assert wait_until(lambda: p.url not in members(front), 5)  # and left the fleet at once
        assert d.metrics()["pd_kv_transfer_failures_total"] == 0


def test_a_drain_ends_at_its_deadline(model, tmp_path) -> None:
    with running_server(model, tmp_path / "p.log", "--role", "prefill", "--drain-timeout", "1",
                        "--kv-lease-seconds", "60") as p:
        prefill(p, BODY)  # kept for a D that never comes
        stopped = time.monotonic()
        p.process.send_signal(signal.SIGTERM)
        assert p.process.wait(30) == 0
        assert 0.8 <= time.monotonic() - stopped < 10


def test_a_decode_server_stopped_mid_stream_finishes_it_and_the_fleet_serves_on(model, tmp_path) -> None:
    with contextlib.ExitStack() as stack:
        front = stack.enter_context(running_proxy(tmp_path / "proxy.log", "--admin-key", "k"))
        joining = ("--register", front.url, "--register-lease", "3", "--drain-timeout", "30")
        p = stack.enter_context(running_server(model, tmp_path / "p.log", "--role", "prefill", *joining))
        d1 = stack.enter_context(running_server(model, tmp_path / "d1.log", "--role", "decode", *joining))
        d2 = stack.enter_context(running_server(model, tmp_path / "d2.log", "--role", "decode", *joining))
        assert wait_until(lambda: len(members(front)) == 3, 30)
        reference, long_reference = complete(p, BODY).token_ids, complete(p, LONG).token_ids
        decode = {d1.url: d1, d2.url: d2}

        with http_client().stream("POST", f"{front.url}/v1/completions", timeout=60,
                                  json=LONG | {"stream": True, "return_token_ids": True}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            serving = [url for url in decode if members(front)[url]["outstanding"]]
            assert len(serving) == 1, members(front)
            stopped = decode[serving[0]]
            stopped.process.send_signal(signal.SIGTERM)
            with ThreadPoolExecutor(2) as pool:  # the fleet keeps serving while it drains
                answers = list(pool.map(lambda _: stream(front, BODY).token_ids, range(6)))
            rest = [line for line in lines if line.startswith("data: {")]
        tokens = [t for line in [first, *rest] for t in json.loads(line[6:])["choices"][0]["token_ids"]]
        assert tokens == long_reference  # the stream it had was finished whole
        assert answers == [reference] * 6
        assert stopped.process.wait(30) == 0
        assert wait_until(lambda: stopped.url not in members(front), 5)
        other = d2 if stopped is d1 else d1
        for server in (p, other):
            assert wait_until(lambda s=server: s.metrics()["pd_kv_cache_usage"] == 0
                              and s.metrics()["pd_kv_requests_held"] == 0, 30)
