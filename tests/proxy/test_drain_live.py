"""`pd serve` drains on SIGTERM (pd/server/drain.py): a prefill server keeps the blocks a
decode server has yet to read and serves that read, refuses new requests with 503
server_draining, tells the proxy it registered with, and exits once nothing is left (or
its drain's time is over). A decode server stopped mid-stream hands the stream on with
its KV (the other decode server reads it and computes nothing again), and requests
through the proxy meanwhile go to the other decode server; nothing fails. KV handed on
is read once, by a server that holds the signed parameters for exactly those tokens:
forged or replayed parameters are refused (403); with `--kv-digest` it is digested at
the pause and checked by its reader."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from launch import http_client
from tests.support.pd_client import complete, prefill, stream
from tests.support.server_harness import running_proxy, running_server, wait_until
from wire.codes import MIGRATED
from wire.headers import PD_MIGRATABLE
from wire.kv_params import KV_TRANSFER_PARAMS

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


def computed(server) -> float:
    """Prompt tokens the server computed (not read from another, nor found in its cache)."""
    return server.metrics().get('pd_prompt_tokens_by_source_total{source="computed"}', 0.0)


def test_a_decode_server_stopped_mid_stream_hands_it_on_with_its_kv(model, tmp_path) -> None:
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
            other = d2 if stopped is d1 else d1
            stopped.process.send_signal(signal.SIGTERM)
            with ThreadPoolExecutor(2) as pool:  # the fleet keeps serving while it drains
                answers = list(pool.map(lambda _: stream(front, BODY).token_ids, range(6)))
            rest = [line for line in lines if line.startswith("data: {")]
        chunks = [json.loads(line[6:]) for line in [first, *rest]]
        assert not [c for c in chunks if "error" in c]
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == long_reference  # no seam
        assert len({c["id"] for c in chunks}) == 1
        assert answers == [reference] * 6
        assert stopped.process.wait(30) == 0  # once the other server read what it kept
        assert wait_until(lambda: stopped.url not in members(front), 5)
        samples = front.metrics()
        assert samples['pd_proxy_migrations_total{outcome="moved",reason="drain"}'] == 1
        assert samples['pd_proxy_migrated_tokens_total{how="moved"}'] > 0
        assert samples['pd_proxy_migrated_tokens_total{how="replayed"}'] == 0
        assert computed(other) == 0  # it read the stream's prompt and tokens: computed none of them
        assert other.metrics()["pd_kv_transfer_failures_total"] == 0
        for server in (p, other):
            assert wait_until(lambda s=server: s.metrics()["pd_kv_cache_usage"] == 0
                              and s.metrics()["pd_kv_requests_held"] == 0, 30)


def handed_on(d, body: dict) -> tuple[list[int], dict]:
    """A stream straight at `d`, which is stopped once it is under way: the tokens it sent
    and the `migrated` error event it ended with (what the proxy resumes from)."""
    tokens, error, stopped = [], None, False
    with http_client().stream("POST", f"{d.url}/v1/completions", timeout=60, headers={PD_MIGRATABLE: "1"},
                              json=body | {"stream": True, "return_token_ids": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]
                continue
            tokens += chunk["choices"][0]["token_ids"]
            if len(tokens) >= 4 and not stopped:  # a chunk may carry several tokens (a busy client)
                d.process.send_signal(signal.SIGTERM)
                stopped = True
    assert error is not None and error["code"] == MIGRATED, error
    return tokens, error


def test_kv_handed_on_is_read_once_and_only_with_its_own_signed_parameters(model, tmp_path) -> None:
    with contextlib.ExitStack() as stack:
        d1 = stack.enter_context(running_server(model, tmp_path / "d1.log", "--role", "decode", "--kv-digest",
                                                "--drain-timeout", "60", "--kv-lease-seconds", "60"))
        d2 = stack.enter_context(running_server(model, tmp_path / "d2.log", "--role", "decode"))
        whole = complete(d2, LONG).token_ids
        tokens, error = handed_on(d1, LONG)
        (params,) = error[KV_TRANSFER_PARAMS]
        assert params["num_prompt_tokens"] > len(tokens) and params["first_token_ids"] == tokens[-1:]
        assert len(params["kv_digests"]) == 1  # --kv-digest: its KV as it stood at the pause, digested
        assert tokens == whole[:len(tokens)]

        def resume(kv: dict, token_ids: list[int] = tokens) -> httpx.Response:
            choice = {"token_ids": token_ids, "text_chars": 0, KV_TRANSFER_PARAMS: kv}
            return http_client().post(f"{d2.url}/v1/completions", timeout=60, json=LONG | {
                "stream": True, "return_token_ids": True, "resume": {"choices": [choice]}})

        forged = resume(params | {"remote_block_ids": [[1] * len(ids) for ids in params["remote_block_ids"]]})
        assert forged.status_code == 403 and forged.json()["error"]["code"] == "kv_transfer_params_refused"
        other_tokens = resume(params, tokens[:-1] + [(tokens[-1] + 1) % 100])  # issued for other tokens
        assert other_tokens.status_code == 400, other_tokens.text
        assert d1.process.poll() is None  # still draining: it keeps the KV for its reader

        before = computed(d2)
        read = resume(params)
        assert read.status_code == 200, read.text
        rest = [t for line in read.text.splitlines() if line.startswith("data: {")
                for t in json.loads(line[6:])["choices"][0]["token_ids"]]
        assert tokens + rest == whole
        assert computed(d2) == before  # nothing of the prompt computed: it was read
        assert d2.metrics()["pd_kv_transfer_failures_total"] == 0
        assert d2.metrics()["pd_kv_transfer_digests_checked_total"] == 1  # every byte read as it was digested
        replayed = resume(params)
        assert replayed.status_code == 403 and "used already" in replayed.json()["error"]["message"]
        assert d1.process.wait(30) == 0  # read: its drain is over
        assert complete(d2, LONG).token_ids == whole  # and the reader serves on, holding nothing
        assert d2.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0
