"""A request handed on at a step boundary (`Scheduler.migrate`, a draining server's
streams) with the NIXL connector's scheduler half on both sides: the server handing it
on finishes it as migrated and keeps exactly the blocks of every token but the last
(per KV cache group: full attention, sliding window, Mamba), under parameters that name
them; the server taking it over reads them and computes nothing again but that last
token, and the request goes on as if it had never moved. The bytes themselves move in
the live tests (tests/proxy/test_drain_live.py). With `--kv-digest` the KV is digested as
it stands after the last step, and the parameters carry the digests."""

from __future__ import annotations

import pytest

from connectors.nixl.digest_book import DigestBook
from connectors.nixl.scheduler import NixlConnectorScheduler
from pd.config import SchedulerConfig, SchedulerSettings
from pd.contracts.connector_api import KVConnectorOutput
from pd.contracts.request import Request, RequestStatus
from pd.contracts.sampling_params import SamplingParams
from pd.kv_cache.kv_cache_manager import KVCacheManager
from pd.kv_cache.layout import make_kv_cache_config
from pd.kv_cache.spec import MambaSpec, cdiv
from pd.kv_transfer.signing import prompt_digest
from pd.scheduling.scheduler import Scheduler
from tests.support.toy_scheduler import BLOCK, MODELS, ToyRunner, reference_outputs

PROMPT = list(range(10, 10 + 2 * BLOCK + 5))  # two full blocks and a partial one
MAX_TOKENS = 40


def server(model: str) -> tuple[Scheduler, KVCacheManager, ToyRunner]:
    specs = {f"l{i}": spec for i, spec in enumerate(MODELS[model])}
    kv = KVCacheManager(make_kv_cache_config(specs, 10**7, 512), True, 512)
    mamba = [spec.block_size for spec in specs.values() if isinstance(spec, MambaSpec)]
    connector = NixlConnectorScheduler("engine", "127.0.0.1", 5600, [BLOCK] * len(kv.config.groups), 30.0)
    config = SchedulerConfig(SchedulerSettings(8, 64, reserve_growth_tokens=0), 512, frozenset(),
                             mamba[0] if mamba else None)
    scheduler = Scheduler(config, kv, connector)
    return scheduler, kv, ToyRunner(kv, config)


def step(scheduler: Scheduler, runner: ToyRunner, landed: set[str] = frozenset()) -> list:
    so = scheduler.schedule()
    out = runner.execute(so)
    out.kv_connector_output = KVConnectorOutput(finished_recving=set(landed))
    return scheduler.update_from_output(so, out)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_request_handed_on_keeps_its_kv_for_the_next_server_which_computes_only_its_last_token(model) -> None:
    old, old_kv, old_runner = server(model)
    request = Request("r", list(PROMPT), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    old.add_request(request)
    for _ in range(8):
        step(old, old_runner)
    assert old.migrate(["unknown"]) == [] and not old.to_migrate
    (handed,) = old.migrate(["r"])  # at the step boundary: ready now
    outputs = list(request.output_token_ids)
    assert handed.finish_reason == "migrated" and request.status is RequestStatus.FINISHED_MIGRATED
    params = handed.kv_transfer_params
    covered = len(PROMPT) + len(outputs) - 1
    assert params.num_prompt_tokens == covered and params.first_token_ids == outputs[-1:]
    assert params.prompt_digest == prompt_digest(PROMPT + outputs[:-1])
    assert [len(ids) for ids in params.remote_block_ids] == [cdiv(covered, BLOCK)] * len(old_kv.config.groups)
    assert old_kv.usage > 0 and "r" in old.remote_kv.delayed_free  # kept for the reader
    assert old.migrated() == [] and not old.to_migrate

    new, new_kv, new_runner = server(model)
    resumed = Request("r", list(PROMPT), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                      kv_transfer_params=params, output_token_ids=list(outputs))
    new.add_request(resumed)
    scheduled = []
    while new.has_unfinished_requests:
        so = new.schedule()
        scheduled.append(so.num_scheduled_tokens.get("r", 0))
        out = new_runner.execute(so)
        out.kv_connector_output = KVConnectorOutput(finished_recving={"r"} if len(scheduled) == 1 else set())
        new.update_from_output(so, out)
    assert new.connector.build_connector_meta().reqs_to_recv == []  # one read, posted at admission
    assert scheduled[:2] == [0, 1]  # waits for its KV, then computes its last token alone
    assert resumed.output_token_ids == reference_outputs(PROMPT, MAX_TOKENS)  # as if it had never moved
    assert resumed.prompt_sources["computed"] == 0
    assert new_kv.usage == 0

    old.remote_kv.update(KVConnectorOutput(finished_sending={"r"}))  # the reader said it is done
    assert old_kv.usage == 0


def test_a_request_is_handed_on_only_once_its_kv_holds_every_token_but_its_last() -> None:
    old, _, runner = server("full")
    request = Request("r", list(PROMPT), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    old.add_request(request)
    assert old.migrate(["r"]) == []  # its prompt is not computed yet: marked, not moved
    outputs = step(old, runner)
    assert [o.finish_reason for o in outputs] == [None, "migrated"]  # after the step that sampled its first token
    assert outputs[1].kv_transfer_params.num_prompt_tokens == len(PROMPT)


def test_parameters_for_other_tokens_are_refused_and_the_holder_told() -> None:
    old, _, runner = server("full")
    old.add_request(Request("r", list(PROMPT), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)))
    for _ in range(4):
        step(old, runner)
    (handed,) = old.migrate(["r"])
    new, new_kv, new_runner = server("full")
    tokens = reference_outputs(PROMPT, 5)  # one more than the KV was kept for
    new.add_request(Request("r", list(PROMPT), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                            kv_transfer_params=handed.kv_transfer_params, output_token_ids=tokens))
    outputs = step(new, new_runner) + step(new, new_runner)
    assert new.connector.build_connector_meta().reqs_to_recv == []
    assert new.connector.num_rejected == 1  # its holder is told to free it
    assert outputs and all(o.error is None for o in outputs)  # computed here instead (the policy's default)


def test_with_kv_digests_a_request_is_handed_on_after_a_step_that_digested_its_kv() -> None:
    old, _, runner = server("gemma3")
    old.connector.digests = DigestBook(1)  # --kv-digest: its ranks digest what a reader will read
    request = Request("r", list(PROMPT), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    old.add_request(request)
    for _ in range(4):
        step(old, runner)
    assert old.migrate(["r"]) == []  # ready, but its KV is digested in a step first
    so = old.schedule()
    covered = request.num_tokens  # once this step computed its last token
    assert so.kv_connector_metadata.reqs_to_digest == [
        ("r", [ids[:cdiv(covered, BLOCK)] for ids in old.kv.get_block_ids("r")])]
    old.connector.digests.put("r", 0, b"the rank's digests")  # the worker half, after the step
    outputs = old.update_from_output(so, runner.execute(so))
    assert [o.finish_reason for o in outputs] == [None, "migrated"]
    params = outputs[1].kv_transfer_params
    assert params.num_prompt_tokens == covered and params.kv_digests == [b"the rank's digests"]
