"""The disk tier under prefill/decode disaggregation: a prefill server whose prompts left
its KV cache loads them from its disk and hands them to the decode server as usual, and
the decode server's received blocks age into its own tier, from which it serves them
later (a full-attention model's: a hybrid's D receives no Mamba boundary state to hit).
Tokens equal the colocated server's; both servers end with their KV at 0. With
`--kv-digest`, P digests what it hands out from under its tiers as it does without them
(D checks every read). The tiers wrap the connector's scheduler half and forward every
call they do not handle themselves."""

from __future__ import annotations

import contextlib
import random

import pytest

from pd.contracts.connector_api import KVConnectorScheduler
from pd.kv_offload.connector import TieredScheduler
from tests.support.pd_client import complete, p_then_d
from tests.support.server_harness import running_server, started_together

FROM_DISK = 'pd_prompt_tokens_by_source_total{source="disk"}'
CACHE = {"qwen3": "2400000", "bamba": "3600000"}  # far less than the prompts take


@pytest.mark.parametrize("arch", ["qwen3", "bamba"])
def test_p_loads_from_its_disk_and_d_keeps_what_it_received_on_its_own(arch, tiny_models, colocated, tmp_path):
    rng = random.Random(arch)
    prompts = [[rng.randrange(300, 3800) for _ in range(300)] for _ in range(5)]
    body = lambda prompt: {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}  # noqa: E731
    expected = [complete(colocated[arch], body(p)).token_ids for p in prompts]
    flags = ("--kv-connector", "nixl", "--max-model-len", "512", "--kv-cache-memory", CACHE[arch], "--kv-digest")
    with contextlib.ExitStack() as stack:
        p, d = (stack.enter_context(running_server(tiny_models[arch], tmp_path / f"{name}.log", *flags,
                                                   "--kv-offload-disk-path", str(tmp_path / name), wait=False))
                for name in ("p", "d"))
        started_together(stack, p, d)
        for round_ in range(2):
            assert [p_then_d(p, d, body(prompt)).token_ids for prompt in prompts] == expected, round_
        assert p.metrics()[FROM_DISK] > 0  # round 2's prefills came back from P's disk
        assert d.metrics()["pd_kv_transfer_digests_checked_total"] == 2 * len(prompts)  # every read checked
        assert d.metrics()['pd_kv_offload_stored_blocks_total{tier="disk"}'] > 0
        d_before = d.metrics()[FROM_DISK]
        assert [complete(d, body(prompt)).token_ids for prompt in prompts] == expected  # D alone now
        # A hybrid's D holds the prompt's final Mamba state only, not the boundary states a hit needs
        # (the same with no tier): only full attention's prompts come back from D's disk.
        assert (d.metrics()[FROM_DISK] > d_before) == (arch == "qwen3")
        for server in (p, d):
            assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0
            assert server.metrics()['pd_kv_offload_on{tier="disk"}'] == 1


def test_the_tiers_forward_every_call_of_the_connector_they_wrap() -> None:
    """A call the tiers did not forward fell back to the base class's no-op: P's digests
    under tiers were never made (`prompt_computed`), and D read unchecked KV."""
    calls = {name for name, value in vars(KVConnectorScheduler).items()
             if not name.startswith("_") and (callable(value) or isinstance(value, property))}
    assert calls - set(vars(TieredScheduler)) == set()
