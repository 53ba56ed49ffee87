"""Prefill and decode servers of different tensor-parallel sizes (real servers, real NIXL
between every rank's agent on 127.0.0.1): P at TP 1 and D at TP 2, P at 2 and D at 1,
both at 2. Every answer equals the colocated TP = 1 server's, for an attention model,
a sliding-window one and a Mamba hybrid, prompts around the block sizes; every read
came from P (none fell back to recomputing) and every server's KV is back to 0. Faults:
a side channel that leaves a rank out, a P gone before D reads; D computes the request
itself, with the right tokens, and serves on. Every server digests what it holds for
readers (`--kv-digest`): every read, of whichever ranks' heads, is checked against them."""

from __future__ import annotations

import contextlib
import os
import random

import msgspec
import pytest

from connectors.nixl.handshake import SideChannelServer, fetch_remote_layout, handshake_request
from connectors.nixl.peer_messages import HandshakeResponse, rank_agent_name
from launch import http_client
from pd.config import EngineConfig
from pd.kv_transfer.params import RemotePrefillParams
from pd.kv_transfer.signing import handshake_key, secret_from_env, sign
from pd.worker.rank_setup import whole_kv_cache_config
from proxy.body import export_body, prefill_body
from tests.support.pd_client import complete, p_then_d, prefill
from tests.support.server_harness import running_server, started_together

pytestmark = pytest.mark.slow  # not heavy: its five ranks should not start beside the heavy Gemma modules
# Around the block sizes (16; 144 for the hybrid): single tokens, partial, exact and
# just-over blocks, several blocks.
PROMPT_LENGTHS = [1, 15, 16, 17, 50, 143, 144, 145, 300]
MAX_TOKENS = 6
PAIRS = [("one", "two"), ("two", "one"), ("two", "other_two")]  # (P, D): TP 1 -> 2, 2 -> 1, 2 -> 2
SIZES = {"one": 1, "two": 2, "other_two": 2}
KV_MEMORY = 32 << 20  # per rank: five ranks run at once beside the rest of the suite


@pytest.fixture(scope="module", params=["qwen3", "gemma3", "bamba"])
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def servers(arch, tiny_models, colocated, tmp_path_factory):
    logs = tmp_path_factory.mktemp(f"pd-tp-{arch}")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with contextlib.ExitStack() as stack:
        start = lambda name, tp: stack.enter_context(running_server(  # noqa: E731
            tiny_models[arch], logs / f"{name}.log", "--kv-connector", "nixl", "--tensor-parallel-size", tp,
            "--kv-cache-memory", str(KV_MEMORY), "--kv-digest", wait=False))
        servers = {name: start(name, str(size)) for name, size in SIZES.items()}
        reference = colocated[arch]
        started_together(stack, *servers.values())
        yield servers | {"c": reference}


def counter(server, name: str) -> float:
    return server.metrics().get(name, 0.0)


@pytest.mark.parametrize("pair", PAIRS, ids=["p1-d2", "p2-d1", "p2-d2"])
def test_p_then_d_of_other_tp_sizes_gives_the_colocated_tokens(servers, arch, pair, tiny_models) -> None:
    """Streamed and not. For qwen3 (one full-attention group, its two KV heads split at
    TP 2) D's ranks read together exactly the prompt's blocks, whole, once, and in at
    most one descriptor per block per (P rank, D rank) pair: never one per layer."""
    p, d = servers[pair[0]], servers[pair[1]]
    rng = random.Random(f"tp-{arch}-{pair}")
    reads_before = counter(d, "pd_kv_transfer_reads_total")
    checked_before = counter(d, "pd_kv_transfer_digests_checked_total")
    row_bytes = whole_kv_cache_config(
        EngineConfig.from_flat(model=str(tiny_models[arch])).resolve()).cross_layer_page_bytes
    ranks = max(SIZES[name] for name in pair)
    for i, n in enumerate(PROMPT_LENGTHS):
        body = {"prompt": [rng.randrange(300, 3800) for _ in range(n)], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True}
        expected = complete(servers["c"], body)
        before = d.metrics()
        got = p_then_d(p, d, body, streamed=i % 2 == 1)
        assert (got.token_ids, got.text) == (expected.token_ids, expected.text), n
        if arch == "qwen3":
            blocks, read = -(-n // 16), read_since(d, before)
            assert read["pd_kv_transfer_bytes_total"] == blocks * row_bytes, n
            assert read["pd_kv_transfer_descriptors_total"] <= blocks * ranks, n
            # each D rank read its heads of every block: its share of the row, none twice
            d_ranks = [str(r) for r in range(SIZES[pair[1]])]
            assert [read[f'pd_kv_transfer_rank_bytes_total{{rank="{r}"}}'] for r in d_ranks] == \
                [blocks * row_bytes // len(d_ranks)] * len(d_ranks), n
            assert sum(read[f'pd_kv_transfer_rank_descriptors_total{{rank="{r}"}}'] for r in d_ranks) == \
                read["pd_kv_transfer_descriptors_total"], n
    assert counter(d, "pd_kv_transfer_reads_total") - reads_before == len(PROMPT_LENGTHS)
    # every byte each D rank read, of whichever P rank's heads, matched P's ranks' digests (--kv-digest)
    assert counter(d, "pd_kv_transfer_digests_checked_total") - checked_before == len(PROMPT_LENGTHS)
    for server in (p, d):
        assert counter(server, "pd_kv_transfer_failures_total") == 0
        assert server.wait_for_metric("pd_kv_requests_held", lambda v: v == 0) == 0
        assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0


@pytest.mark.parametrize("pair", PAIRS, ids=["p1-d2", "p2-d1", "p2-d2"])
def test_p_reads_a_prefix_from_d_of_another_tp_size(servers, arch, pair) -> None:
    """Issue 34's D -> P read across TP sizes: D answers a first turn itself and exports
    the next turn's prefix it holds; P's ranks read their heads of it from D's, compute
    the rest, and D reads back what it lacks: the colocated tokens."""
    p, d = servers[pair[0]], servers[pair[1]]
    block = 144 if arch == "bamba" else 16
    rng = random.Random(f"tp-reuse-{arch}-{pair}")
    first = [rng.randrange(300, 3800) for _ in range(block + 5)]
    answer = complete(d, {"prompt": first, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}).token_ids
    prompt = first + answer + [rng.randrange(300, 3800) for _ in range(block)]
    held = (len(first) + MAX_TOKENS - 1) // block * block
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    prefix = complete(d, export_body(body, prompt[:held])).body["kv_transfer_params"]
    read_before = counter(p, 'pd_prompt_tokens_by_source_total{source="remote"}')
    checked_before = counter(p, "pd_kv_transfer_digests_checked_total")
    params = complete(p, prefill_body(body, prefix)).body["kv_transfer_params"]
    assert counter(p, 'pd_prompt_tokens_by_source_total{source="remote"}') - read_before == held
    assert counter(p, "pd_kv_transfer_digests_checked_total") - checked_before == 1  # D's ranks' digests
    assert complete(d, body | {"kv_transfer_params": params}).token_ids == complete(servers["c"], body).token_ids
    for server in (p, d):
        assert counter(server, "pd_kv_transfer_failures_total") == 0
        assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0


def read_since(server, before: dict[str, float]) -> dict[str, float]:
    """How far each transfer counter of `server` moved since `before`."""
    return {key: value - before.get(key, 0.0) for key, value in server.metrics().items()
            if key.startswith("pd_kv_transfer_")}


def test_kv_memory_is_reported_per_rank(servers) -> None:
    """pd_kv_cache_bytes{rank}: one series per rank, each holding its heads of the same
    blocks within the memory it was given."""
    for name, size in SIZES.items():
        metrics = servers[name].metrics()
        per_rank = [metrics.get(f'pd_kv_cache_bytes{{rank="{r}"}}') for r in range(size)]
        assert len(set(per_rank)) == 1 and 0 < per_rank[0] <= KV_MEMORY, (name, per_rank)
        assert f'pd_kv_cache_bytes{{rank="{size}"}}' not in metrics


def resigned(params: dict, **changes) -> dict:
    """P's parameters with `changes`, signed again with the deployment's secret (as a P
    that lies about its side channel would)."""
    typed = msgspec.structs.replace(msgspec.convert(params, RemotePrefillParams), **changes)
    return sign(typed, secret_from_env()).to_json()


def assert_serves_and_kv_back_to_0(servers, d) -> None:
    body = {"prompt": "After the fault the server answers as before.", "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    assert complete(d, body).token_ids == complete(servers["c"], body).token_ids
    assert d.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0


@pytest.mark.parametrize("arch", ["qwen3"], indirect=True)
def test_a_side_channel_missing_a_rank_fails_the_read_and_d_recomputes(servers, arch, tiny_models,
                                                                      tmp_path) -> None:
    """A P side channel (forged, signed parameters pointing at it) that describes P's rank
    0 but not rank 1: D's rank 1 finds no P rank with its heads, while rank 0's data has
    landed. The request is computed on D with the right tokens (rank 0 waited for rank 1
    before giving the blocks up), P is told and frees its blocks, D's KV is back to 0."""
    d = servers["other_two"]
    body = {"prompt": "A prefill server's side channel leaves out one of its ranks. " * 3,
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    with running_server(tiny_models[arch], tmp_path / "p.log", "--kv-connector", "nixl",  # a P no D has met
                        "--tensor-parallel-size", "2", "--kv-cache-memory", str(KV_MEMORY)) as p:
        params = prefill(p, body).body["kv_transfer_params"]
        compat = http_client().get(f"{p.url}/v1/kv_config", timeout=10).json()["compat_hash"]
        d_agent = rank_agent_name(http_client().get(f"{d.url}/v1/kv_config", timeout=10).json()["engine_id"], 0)
        # in D's name: P takes notifications only from agents its side channel answered
        request = handshake_request(d_agent, compat, handshake_key(secret_from_env()))
        real = fetch_remote_layout("127.0.0.1", params["remote_port"], request, 5.0)
        assert len(real.ranks) == 1  # P's rank 1
        forged = SideChannelServer("127.0.0.1", 0, lambda _: HandshakeResponse(real.agent_metadata, real.layout))
        failures = counter(d, "pd_kv_transfer_failures_total")
        try:
            got = complete(d, body | {"kv_transfer_params": resigned(params, remote_port=forged.port)})
        finally:
            forged.close()
        assert got.token_ids == complete(servers["c"], body).token_ids
        assert counter(d, "pd_kv_transfer_failures_total") == failures + 1
        assert p.wait_for_metric("pd_kv_requests_held", lambda v: v == 0) == 0  # the reject reached P
    assert_serves_and_kv_back_to_0(servers, d)


@pytest.mark.parametrize("arch", ["qwen3"], indirect=True)
def test_p_gone_before_d_reads_d_recomputes_on_every_rank(servers, arch, tiny_models, tmp_path) -> None:
    """P (TP 2) stops after its prefill: every D rank's handshake fails; the request is
    computed on D (TP 2) with the right tokens and D's KV is back to 0."""
    body = {"prompt": "The prefill server went away before the decode server read. " * 3,
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    with running_server(tiny_models[arch], tmp_path / "gone.log", "--kv-connector", "nixl",
                        "--tensor-parallel-size", "2", "--kv-cache-memory", str(KV_MEMORY)) as gone:
        params = prefill(gone, body).body["kv_transfer_params"]
    d = servers["other_two"]
    assert complete(d, body | {"kv_transfer_params": params}).token_ids == complete(servers["c"], body).token_ids
    assert_serves_and_kv_back_to_0(servers, d)
