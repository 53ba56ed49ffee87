"""PD on a machine with a GPU: a prefill and a decode server on one CUDA device, real
NIXL between them (their KV tensors registered as VRAM; UCX's CUDA transports on one
host), and a pair whose KV is in host memory beside the GPU. Every answer equals a
colocated server's on the same device; every read came from P.

Skipped where torch sees no CUDA device or NIXL is not installed (CI); run on a GPU
machine when one is lent."""

from __future__ import annotations

import contextlib
import os
import random

import pytest
import torch

from tests.support.pd_client import complete, p_then_d
from tests.support.server_harness import running_server, started_together


def nixl_installed() -> bool:
    from pd.kv_transfer.nixl_api import load_nixl

    try:
        load_nixl()
    except ImportError:
        return False
    return True


pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
              pytest.mark.skipif(not nixl_installed(), reason="NIXL is not installed")]

PROMPT_LENGTHS = [1, 16, 17, 143, 145, 300]  # around the blocks of 16 (qwen3, gemma3) and 144 (bamba)
FLAGS = ("--dtype", "float32", "--kv-cache-memory", str(64 << 20))


@pytest.fixture(scope="module", params=[("qwen3", "cuda"), ("gemma3", "cuda"), ("bamba", "cuda"), ("qwen3", "cpu")],
                ids=["qwen3", "gemma3", "bamba", "qwen3-kv-in-host-memory"])
def servers(request, tiny_models, tmp_path_factory):
    """P, D and a colocated server of `arch` on `device`. KV in host memory on a machine
    with a GPU: NIXL's UCX backend refused to start with the one-host transports that
    leave CUDA out (this test failed before `configure_ucx` added them where GPUs are)."""
    arch, device = request.param
    logs = tmp_path_factory.mktemp(f"cuda-pd-{arch}-{device}")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with contextlib.ExitStack() as stack:
        start = lambda name, *more: stack.enter_context(running_server(  # noqa: E731
            tiny_models[arch], logs / f"{name}.log", "--device", device, *FLAGS, *more, wait=False))
        servers = {"p": start("p", "--kv-connector", "nixl"), "d": start("d", "--kv-connector", "nixl"),
                   "c": start("c")}
        started_together(stack, *servers.values())
        yield arch, servers


def test_pd_on_a_gpu_machine_gives_the_colocated_tokens(servers) -> None:
    arch, s = servers
    rng = random.Random(f"cuda-pd-{arch}")
    for i, n in enumerate(PROMPT_LENGTHS):
        body = {"prompt": [rng.randrange(300, 3800) for _ in range(n)], "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}
        got = p_then_d(s["p"], s["d"], body, streamed=i % 2 == 1)
        assert got.token_ids == complete(s["c"], body).token_ids, n
    metrics = s["d"].metrics()
    assert metrics["pd_kv_transfer_reads_total"] == len(PROMPT_LENGTHS)  # none recomputed on D
    assert metrics["pd_kv_transfer_failures_total"] == 0 and metrics["pd_kv_transfer_bytes_total"] > 0
    for server in (s["p"], s["d"]):
        assert server.wait_for_metric("pd_kv_requests_held", lambda v: v == 0) == 0
        assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0
