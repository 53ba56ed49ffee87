"""A prefill server reading a prefix's KV from a decode server (D -> P, issue 34's
`disaggregated+reuse` path), done by hand on real qwen3 servers with real NIXL: D
computes a conversation's turn itself, exports the prefix of the next turn it holds
(`export_body`), P reads that prefix from D and computes only the rest (`prefill_body`
with `prefix`), D reads from P only what it lacks and decodes: colocated's tokens. A
prefix P cannot read (released by its holder, a holder that never answers or is gone)
is computed on P: the same tokens, and every block back. Every family takes the path through the
proxy in tests/proxy/test_conditional_live.py."""

from __future__ import annotations

import contextlib
import os
import random

import msgspec
import pytest

from launch import http_client
from launch.process import SECRET_ENV
from pd.kv_transfer.params import RemotePrefillParams
from pd.kv_transfer.signing import sign
from proxy.body import export_body, prefill_body
from tests.support.listeners import ConnectionRecorder
from tests.support.pd_client import complete, stream
from tests.support.server_harness import Starter, free_port

pytestmark = pytest.mark.slow
ANSWER = 12


def remote(server) -> float:
    return server.metrics()['pd_prompt_tokens_by_source_total{source="remote"}']


@pytest.fixture(scope="module")
def pair(tiny_models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("reuse")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with contextlib.ExitStack() as stack:
        p, d = Starter(tiny_models["qwen3"], logs, stack).all(("p", "--role", "prefill"), ("d", "--role", "decode"))
        yield "qwen3", 16, p, d


def next_turn(d, rng: random.Random, block: int) -> tuple[list[int], int]:
    """A conversation's first turn computed on D alone; the next turn's prompt, and the
    tokens of it D holds in full blocks (the prefix it can export)."""
    first = [rng.randrange(300, 3800) for _ in range(2 * block + 5)]
    answer = complete(d, {"prompt": first, "max_tokens": ANSWER, "temperature": 0, "ignore_eos": True}).token_ids
    prompt = first + answer + [rng.randrange(300, 3800) for _ in range(block + 3)]
    return prompt, (len(first) + ANSWER - 1) // block * block


def export(d, body: dict, prompt: list[int], num_tokens: int) -> dict:
    params = complete(d, export_body(body, prompt[:num_tokens])).body["kv_transfer_params"]
    assert params["num_prompt_tokens"] == num_tokens
    return params


def test_p_reads_the_prefix_d_holds_computes_the_rest_and_d_answers_as_colocated(pair, colocated) -> None:
    arch, block, p, d = pair
    prompt, held = next_turn(d, random.Random(3), block)
    body = {"prompt": prompt, "max_tokens": ANSWER, "temperature": 0, "ignore_eos": True}
    read_by_p, read_by_d = remote(p), remote(d)
    prefix = export(d, body, prompt, held)
    params = complete(p, prefill_body(body, prefix)).body["kv_transfer_params"]
    assert remote(p) - read_by_p == held  # P held nothing: the whole prefix came from D
    got = stream(d, body | {"kv_transfer_params": params})
    assert got.token_ids == complete(colocated[arch], body).token_ids, arch
    assert 0 < remote(d) - read_by_d <= len(prompt) - held + block  # D read what it lacked of P's
    for server in (p, d):
        assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0


def release(d, prefix: dict) -> None:
    released = http_client().post(f"{d.url}/v1/kv/release", timeout=10, json={
        "remote_request_id": prefix["remote_request_id"], "signature": prefix["signature"]})
    assert released.json()["released"] is True


def failed_reads(server) -> float:
    return server.metrics()['pd_kv_load_failures_total{policy="recompute"}']


def test_a_prefix_p_cannot_read_is_computed_on_p(pair, colocated) -> None:
    """The prefix's blocks released by D before P reads (the lease word changed), a prefix
    naming a holder that accepts and never answers (the handshake times out), and one
    naming a holder that is gone (nothing listens): P computes the prefix, whatever the
    load failure policy, and D answers colocated's tokens."""
    arch, block, p, d = pair
    rng = random.Random(4)
    recorder = ConnectionRecorder()
    try:
        for case in ("released", "silent holder", "holder gone"):
            prompt, held = next_turn(d, rng, block)
            body = {"prompt": prompt, "max_tokens": ANSWER, "temperature": 0, "ignore_eos": True}
            prefix = export(d, body, prompt, held)
            if case == "released":
                release(d, prefix)
            else:  # another engine, at the recorder's port or where nothing listens (D's own blocks released)
                release(d, prefix)
                port = recorder.port if case == "silent holder" else free_port()
                forged = msgspec.structs.replace(msgspec.convert(prefix, RemotePrefillParams), signature=None,
                                                 remote_engine_id=case.replace(" ", "-"), remote_port=port)
                prefix = sign(forged, os.environ[SECRET_ENV]).to_json()
            before = failed_reads(p)
            params = complete(p, prefill_body(body, prefix)).body["kv_transfer_params"]
            assert failed_reads(p) == before + 1, case
            got = complete(d, body | {"kv_transfer_params": params})
            assert got.token_ids == complete(colocated[arch], body).token_ids, case
    finally:
        recorder.close()
    assert recorder.accepted >= 1
    for server in (p, d):
        assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0
