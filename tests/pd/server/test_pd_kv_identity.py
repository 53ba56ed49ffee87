"""A prefill server whose KV means something else than the decode server's, though its
model has the same architecture and config: other weights (another seed), or the same
weights computed otherwise (`--quantization int8`). Their compatibility hashes differ, so
the handshake refuses the pair and D computes the prompt itself: it answers its own
colocated tokens, never tokens decoded from another model's KV."""

from __future__ import annotations

import contextlib
import os

import pytest

from pd.models.make_model import make_model
from tests.support.pd_client import complete, p_then_d
from tests.support.server_harness import running_server, started_together

pytestmark = pytest.mark.slow
LEASE_S = 10
ARCH = "qwen3"
BODY = {"prompt": "The same architecture, the same config, other weights: the KV is another model's. " * 5,
        "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def servers(tiny_models, colocated, tmp_path_factory):
    logs = tmp_path_factory.mktemp("kv-identity")
    other = make_model(ARCH, tmp_path_factory.mktemp("other-weights") / ARCH, seed=7)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    nixl = ("--kv-connector", "nixl", "--kv-lease-seconds", str(LEASE_S))
    with contextlib.ExitStack() as stack:
        start = lambda name, model, *args: stack.enter_context(  # noqa: E731
            running_server(model, logs / f"{name}.log", *nixl, *args, wait=False))
        servers = {"weights": start("p-other-weights", other), "quantization": start("p-int8", tiny_models[ARCH],
                                                                                     "--quantization", "int8"),
                   "d": start("d", tiny_models[ARCH])}
        started_together(stack, *servers.values())
        yield servers | {"c": colocated[ARCH]}


@pytest.mark.parametrize("change", ["weights", "quantization"])
def test_a_prefill_server_of_other_weights_or_quantization_is_refused_and_d_computes(servers, change) -> None:
    p, d = servers[change], servers["d"]
    before = d.metrics()
    assert p_then_d(p, d, BODY).token_ids == complete(servers["c"], BODY).token_ids
    after = d.metrics()
    assert after["pd_kv_transfer_failures_total"] - before["pd_kv_transfer_failures_total"] == 1
    assert after["pd_kv_transfer_reads_total"] == before["pd_kv_transfer_reads_total"]
    assert "incompatible KV layout" in d.log_tail(20000) and "weights, quantization" in d.log_tail(20000)
    assert p.wait_for_metric("pd_kv_requests_held", lambda v: v == 0, timeout=LEASE_S + 10) == 0
