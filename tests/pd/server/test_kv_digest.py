"""`--kv-digest` on live servers: a bit flipped in the KV a server holds for a reader,
between the step that computed it and the read (written into the engine's memory from
outside, through /proc), is caught by the reader before it uses or caches the blocks.

- P -> D: D recomputes the prompt (the default policy) and answers the colocated tokens;
  its digest-mismatch counter and its trace's KV read span say so; nothing corrupt enters
  its prefix cache (the prompt served again from D's own cache answers the same).
- D -> P (a prefix D exported for P to read): P computes the prefix itself and counts it.
Without a flipped bit every read is checked and matches."""

from __future__ import annotations

import contextlib
import os
import random

import pytest

from connectors.nixl.handshake import fetch_remote_layout, handshake_request
from launch import http_client
from pd.kv_transfer.signing import handshake_key, secret_from_env
from tests.support.otlp import otlp_receiver
from tests.support.pd_client import complete, prefill
from tests.support.server_harness import running_server, started_together, wait_until

pytestmark = pytest.mark.slow
ARCH = "qwen3"
LEASE_S = 10


def body(prompt) -> dict:
    return {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def prompt(seed: int, length: int = 100) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 3800) for _ in range(length)]


@pytest.fixture(scope="module")
def servers(tiny_models, colocated, tmp_path_factory, request):
    logs = tmp_path_factory.mktemp("kv-digest")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with otlp_receiver() as (endpoint, spans), contextlib.ExitStack() as stack:
        flags = ("--kv-connector", "nixl", "--kv-lease-seconds", str(LEASE_S), "--kv-digest",
                 "--otlp-traces-endpoint", endpoint)
        p, d = (stack.enter_context(running_server(tiny_models[ARCH], logs / f"{name}.log", *flags, wait=False))
                for name in ("p", "d"))
        started_together(stack, p, d)
        yield {"p": p, "d": d, "c": colocated[ARCH], "spans": spans}


def flip_a_bit(holder, params: dict) -> None:
    """Flip one bit of the first block `params` name, in the holder's engine memory."""
    compat = http_client().get(f"{holder.url}/v1/kv_config", timeout=10).json()["compat_hash"]
    request = handshake_request("test", compat, handshake_key(secret_from_env()))
    layout = fetch_remote_layout("127.0.0.1", params["remote_port"], request, 5).layout
    block = next(b for b in params["remote_block_ids"][0] if b)
    ref = layout.group_data_refs[0][0]
    tensor = layout.tensors[ref.tensor_idx]
    address = tensor.base_address + block * tensor.row_bytes + ref.offset_bytes + 40
    with open(f"/proc/{holder.engine_pid}/mem", "r+b", buffering=0) as memory:
        memory.seek(address)
        byte = memory.read(1)[0]
        memory.seek(address)
        memory.write(bytes([byte ^ 0x04]))


def test_every_read_is_checked_and_a_clean_one_matches(servers) -> None:
    p, d, c = servers["p"], servers["d"], servers["c"]
    before = d.metrics()
    params = prefill(p, body(prompt(1))).body["kv_transfer_params"]
    assert len(params["kv_digests"]) == 1  # one P rank
    assert complete(d, body(prompt(1)) | {"kv_transfer_params": params}).token_ids == \
        complete(c, body(prompt(1))).token_ids
    after = d.metrics()
    assert after["pd_kv_transfer_digests_checked_total"] == before["pd_kv_transfer_digests_checked_total"] + 1
    assert after["pd_kv_transfer_digest_mismatches_total"] == before["pd_kv_transfer_digest_mismatches_total"]


def test_a_bit_flipped_in_p_s_kv_is_caught_by_d_which_recomputes(servers) -> None:
    p, d, c, spans = servers["p"], servers["d"], servers["c"], servers["spans"]
    text = prompt(2)
    expected = complete(c, body(text)).token_ids
    before = d.metrics()
    params = prefill(p, body(text)).body["kv_transfer_params"]
    flip_a_bit(p, params)
    answer = http_client().post(f"{d.url}/v1/completions", json=body(text) | {"kv_transfer_params": params,
                                "return_token_ids": True}, headers={"X-Request-Id": "flipped"}, timeout=60)
    assert answer.status_code == 200 and answer.json()["choices"][0]["token_ids"] == expected
    after = d.metrics()
    assert after["pd_kv_transfer_digest_mismatches_total"] == before["pd_kv_transfer_digest_mismatches_total"] + 1
    failures = 'pd_kv_load_failures_total{policy="recompute"}'
    assert after[failures] == before[failures] + 1
    assert "not what the holder digested" in d.log_tail(20000) and "flipped" in d.log_tail(20000)
    assert wait_until(lambda: any(s.name == "pd.kv_read" and "not what the holder digested"
                                  in str(s.attributes.get("pd.kv_error")) for s in spans), 30)
    (request,) = [s for s in spans if s.name == "pd.request" and s.attributes.get("pd.request_id") == "flipped"]
    assert request.events == ("pd.kv_load_failed",)  # an event on the request's span too
    assert complete(d, body(text)).token_ids == expected  # from D's own cache: what it recomputed, not P's
    assert p.wait_for_metric("pd_kv_requests_held", lambda v: v == 0, timeout=LEASE_S + 10) == 0  # rejected


def test_a_bit_flipped_in_a_prefix_d_exported_is_caught_by_p(servers) -> None:
    """D exports the first 64 tokens of a prompt it served (a one-token completion kept
    for a reader, as the proxy's reuse path asks); the bit flips in D's memory; P reads the
    prefix, finds it corrupt, and computes it."""
    p, d, c = servers["p"], servers["d"], servers["c"]
    text = prompt(3)
    complete(d, body(text))  # D computes and caches it
    export = complete(d, {"prompt": text[:65], "max_tokens": 1, "temperature": 0,
                          "kv_transfer_params": {"do_remote_decode": True}}).body["kv_transfer_params"]
    assert export["num_prompt_tokens"] == 65 and export["kv_digests"]
    flip_a_bit(d, export)
    before = p.metrics()
    params = complete(p, body(text) | {"kv_transfer_params": {"do_remote_decode": True, "prefix": export}})
    after = p.metrics()
    assert after["pd_kv_transfer_digest_mismatches_total"] == before["pd_kv_transfer_digest_mismatches_total"] + 1
    sources = params.body["usage"]["prompt_tokens_details"]["sources"]
    assert sources.get("remote", 0) == 0 and sources["computed"] == 100  # computed, not read
    assert complete(d, body(text) | {"kv_transfer_params": params.body["kv_transfer_params"]}).token_ids == \
        complete(c, body(text)).token_ids
