"""`--kv-cache-dtype fp8_e4m3|int8` on live servers: P and D with 8-bit caches give the
colocated 8-bit server's tokens and move about a quarter of a float32 cache's bytes; a P and
a D with different KV dtypes are refused at the handshake and D computes the right tokens
itself."""

from __future__ import annotations

import contextlib
import os

import pytest

from tests.support.pd_client import complete, p_then_d
from tests.support.server_harness import running_server, started_together

pytestmark = pytest.mark.slow
LEASE_S = 10
ARCH = "qwen3"  # float32: an 8-bit cache is a quarter of the bytes
BODY = {"prompt": "Eight bits a value: the cache holds twice the tokens of bfloat16, four times float32's. " * 5,
        "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=["fp8_e4m3", "int8"])
def servers(request, tiny_models, colocated, tmp_path_factory):
    logs = tmp_path_factory.mktemp(f"kv-dtype-{request.param}")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    nixl = ("--kv-connector", "nixl", "--kv-lease-seconds", str(LEASE_S))
    fp8 = ("--kv-cache-dtype", request.param)
    with contextlib.ExitStack() as stack:
        start = lambda name, *args: stack.enter_context(  # noqa: E731
            running_server(tiny_models[ARCH], logs / f"{name}.log", *args, wait=False))
        servers = {"p8": start("p8", *nixl, *fp8), "d8": start("d8", *nixl, *fp8), "c8": start("c8", *fp8),
                   "p": start("p", *nixl), "d": start("d", *nixl)}
        started_together(stack, *servers.values())
        yield servers | {"c": colocated[ARCH], "kv_dtype": request.param}


def read(p, d) -> tuple[list[int], float]:
    before = d.metrics()
    got = p_then_d(p, d, BODY)
    after = d.metrics()
    assert after["pd_kv_transfer_reads_total"] - before["pd_kv_transfer_reads_total"] == 1
    return got.token_ids, after["pd_kv_transfer_bytes_total"] - before["pd_kv_transfer_bytes_total"]


def test_an_8_bit_pair_gives_the_8_bit_colocated_tokens_from_a_quarter_of_the_bytes(servers) -> None:
    tokens8, bytes8 = read(servers["p8"], servers["d8"])
    assert tokens8 == complete(servers["c8"], BODY).token_ids
    tokens32, bytes32 = read(servers["p"], servers["d"])
    assert tokens32 == complete(servers["c"], BODY).token_ids
    if servers["kv_dtype"] == "fp8_e4m3":
        assert bytes32 == 4 * bytes8 > 0
    else:  # a float32 scale per row of head_size bytes
        assert 3 * bytes8 < bytes32 < 4 * bytes8
    for name in ("p8", "d8"):
        assert servers[name].wait_for_metric("pd_kv_cache_usage", lambda v: v == 0, timeout=LEASE_S + 10) == 0


def test_a_pair_of_other_kv_dtypes_is_refused_at_the_handshake_and_d_computes(servers) -> None:
    p8, d = servers["p8"], servers["d"]
    before = d.metrics()
    assert p_then_d(p8, d, BODY).token_ids == complete(servers["c"], BODY).token_ids
    after = d.metrics()
    assert after["pd_kv_transfer_failures_total"] - before["pd_kv_transfer_failures_total"] == 1
    assert after["pd_kv_transfer_reads_total"] == before["pd_kv_transfer_reads_total"]
    assert "incompatible KV layout" in d.log_tail(20000)
    assert p8.wait_for_metric("pd_kv_requests_held", lambda v: v == 0, timeout=LEASE_S + 10) == 0
