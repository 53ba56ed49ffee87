"""Scheduler: continuous batching, chunked prefill and preemption against a toy runner.

`ToyRunner` (tests/support/toy_scheduler.py) keeps its own copy of each request exactly
as the model runner does and checks every step; its "model" picks the next token as a
hash of all tokens so far, so any scheduling mistake changes outputs.
"""

from __future__ import annotations

import random

import pytest

from pd.config import SchedulerConfig, SchedulerSettings
from pd.contracts.connector_api import KVConnectorScheduler, NullConnectorScheduler
from pd.contracts.outputs import ModelRunnerOutput, SchedulerOutput
from pd.contracts.request import Request, RequestStatus
from pd.contracts.sampling_params import SamplingParams
from pd.kv_cache.kv_cache_manager import KVCacheManager
from pd.kv_cache.layout import make_kv_cache_config
from pd.kv_transfer.params import RemotePrefillParams
from pd.scheduling.scheduler import Scheduler
from tests.support.toy_scheduler import BLOCK, EOS, MODELS, ToyRunner, attn, reference_outputs, ssm, toy_next_token


def make_scheduler(specs, num_blocks_memory: int, max_num_seqs=8, max_tokens_per_step=64,
                   max_model_len=512, caching=True):
    kv_config = make_kv_cache_config(specs, num_blocks_memory, max_model_len)
    kv = KVCacheManager(kv_config, caching, max_model_len)
    config = SchedulerConfig(SchedulerSettings(max_num_seqs, max_tokens_per_step, reserve_growth_tokens=0),
                             max_model_len, frozenset({EOS}))
    return Scheduler(config, kv, NullConnectorScheduler()), kv


def run_all(scheduler: Scheduler, kv: KVCacheManager, requests: list[Request]) -> dict[str, int]:
    runner = ToyRunner(kv, scheduler.config)
    for r in requests:
        scheduler.add_request(r)
    steps = 0
    while scheduler.has_unfinished_requests:
        so = scheduler.schedule()
        scheduler.update_from_output(so, runner.execute(so))
        kv.check_integrity()
        steps += 1
        assert steps < 10_000, "scheduler made no progress"
    assert kv.usage == 0.0
    return {"preemptions": scheduler.num_preemptions, "steps": steps}


def make_requests(seed: int, n: int, shared_prefix: int = 0) -> list[Request]:
    rng = random.Random(seed)
    prefix = [rng.randrange(10, 500) for _ in range(shared_prefix)]
    return [
        Request(f"r{i}", prefix + [rng.randrange(10, 500) for _ in range(rng.randrange(1, 120))],
                SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0))
        for i in range(n)
    ]


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("memory_blocks", [48, 400])
def test_outputs_survive_chunking_and_preemption(model: str, memory_blocks: int) -> None:
    specs = {f"l{i}": s for i, s in enumerate(MODELS[model])}
    page = make_kv_cache_config(specs, 10**9).cross_layer_page_bytes
    scheduler, kv = make_scheduler(specs, memory_blocks * page)
    requests = make_requests(seed=memory_blocks, n=24, shared_prefix=40)
    stats = run_all(scheduler, kv, requests)
    for r in requests:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.sampling_params.max_tokens)
        assert r.status is RequestStatus.FINISHED_LENGTH_CAPPED
    if memory_blocks == 48:
        assert stats["preemptions"] > 0, "the small pool was meant to force preemption"
    assert kv.stats.hits > 0, "the shared 40-token prefix should hit the prefix cache"


def test_eos_and_stop_token_ids_finish_a_request() -> None:
    specs = {"l0": attn()}
    scheduler, kv = make_scheduler(specs, 10**7)
    prompt = [11, 12, 13]
    first = toy_next_token(prompt)
    stop = Request("stop", prompt, SamplingParams(max_tokens=10, stop_token_ids=(first,)))
    run_all(scheduler, kv, [stop])
    assert stop.output_token_ids == [first]
    assert stop.status is RequestStatus.FINISHED_STOPPED


def test_eos_is_ignored_with_ignore_eos() -> None:
    scheduler, kv = make_scheduler({"l0": attn()}, 10**7)
    scheduler.config = SchedulerConfig(SchedulerSettings(8, 64, reserve_growth_tokens=0), 512,
                                       frozenset({toy_next_token([1, 2])}))
    a = Request("a", [1, 2], SamplingParams(max_tokens=3))
    b = Request("b", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    run_all(scheduler, kv, [a, b])
    assert len(a.output_token_ids) == 1 and a.status is RequestStatus.FINISHED_STOPPED
    assert len(b.output_token_ids) == 3 and b.status is RequestStatus.FINISHED_LENGTH_CAPPED


def test_max_model_len_caps_output_and_rejects_long_prompts() -> None:
    scheduler, kv = make_scheduler({"l0": attn()}, 10**7, max_model_len=40)
    r = Request("r", list(range(10, 45)), SamplingParams(max_tokens=100))
    run_all(scheduler, kv, [r])
    assert r.num_tokens == 40 and r.status is RequestStatus.FINISHED_LENGTH_CAPPED
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(Request("long", list(range(10, 50))))


def test_max_num_seqs_and_token_budget_bound_each_step() -> None:
    scheduler, kv = make_scheduler({"l0": attn()}, 10**7, max_num_seqs=3, max_tokens_per_step=20)
    requests = make_requests(seed=3, n=10)
    stats = run_all(scheduler, kv, requests)  # ToyRunner asserts both bounds every step
    total = sum(r.num_prompt_tokens + len(r.output_token_ids) - 1 for r in requests)
    assert stats["steps"] >= total / 20


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    scheduler, kv = make_scheduler({"l0": attn()}, 10**7, max_num_seqs=1)
    runner = ToyRunner(kv, scheduler.config)
    a = Request("a", list(range(10, 50)), SamplingParams(max_tokens=30))
    b = Request("b", list(range(10, 30)), SamplingParams(max_tokens=30))
    scheduler.add_request(a)
    scheduler.add_request(b)
    so = scheduler.schedule()
    scheduler.update_from_output(so, runner.execute(so))
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING
    outputs = scheduler.abort_requests(["b", "a", "unknown"])
    assert [(o.request_id, o.finish_reason, o.new_token_ids) for o in outputs] == \
        [("b", "abort", []), ("a", "abort", [])]
    assert a.status is RequestStatus.FINISHED_ABORTED and not scheduler.has_work
    assert kv.usage == 0.0
    kv.check_integrity()
    so = scheduler.schedule()
    assert so.finished_req_ids == {"a"} and not so.num_scheduled_tokens  # the runner forgets it


def prefill_chunks(request: Request, mamba_block_size: int | None) -> list[int]:
    scheduler, kv = make_scheduler({"m0": ssm(), "a0": attn()}, 10**7, max_tokens_per_step=40)
    scheduler.config = SchedulerConfig(SchedulerSettings(8, 40, reserve_growth_tokens=0), 512, frozenset(),
                                       mamba_block_size=mamba_block_size)
    runner = ToyRunner(kv, scheduler.config)
    scheduler.add_request(request)
    chunks = []
    while scheduler.has_unfinished_requests:
        so = scheduler.schedule()
        chunks.append(so.num_scheduled_tokens[request.request_id])
        scheduler.update_from_output(so, runner.execute(so))
    return chunks


def test_mamba_prefill_chunks_end_on_block_boundaries_when_the_budget_allows() -> None:
    prompt = list(range(10, 110))
    assert prefill_chunks(Request("r", prompt, SamplingParams(max_tokens=2)), BLOCK) == [32, 32, 36, 1]
    assert prefill_chunks(Request("r", prompt, SamplingParams(max_tokens=2)), None) == [40, 40, 20, 1]
    remote = Request("p", prompt, SamplingParams(max_tokens=2), kv_transfer_params=remote_prefill(len(prompt)))
    assert prefill_chunks(remote, BLOCK) == [40, 40, 20, 1]  # exempt
    tight = prefill_chunks(Request("r", prompt, SamplingParams(max_tokens=2)), 64)
    assert tight == [40, 24, 36, 1]  # no boundary fits the first budget: progress wins


def remote_prefill(num_prompt_tokens: int, first_token_id: int = 0) -> RemotePrefillParams:
    """Well-formed PD parameters (the toy connector reads none of the location fields)."""
    return RemotePrefillParams(True, "p", "127.0.0.1", 1, "p1", [[0]], num_prompt_tokens, [first_token_id], 16)


class ToyRemoteConnector(KVConnectorScheduler):
    """A connector whose 'remote' KV arrives after a given number of steps (the scheduler
    contract only; real transfers are tested with NIXL)."""

    has_work = False  # nothing of its own to step for

    def __init__(self, num_external: int, delay_steps: int, fail: bool = False, verified: bool = True) -> None:
        from pd.contracts.connector_api import KVConnectorMetadata, KVConnectorOutput

        self.meta, self.output = KVConnectorMetadata, KVConnectorOutput
        self.num_external, self.delay, self.fail, self.verified = num_external, delay_steps, fail, verified
        self.loading: dict[str, int] = {}
        self.finished_calls: list[str] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.do_remote_prefill:
            return self.num_external - num_computed_tokens, True
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.loading[request.request_id] = self.delay

    def build_connector_meta(self):
        return self.meta()

    def requests_waiting(self, requests):
        pass

    def request_finished(self, request, block_ids):
        self.finished_calls.append(request.request_id)
        return False, None

    def update_connector_output(self, output):
        pass

    def tick(self):
        done = {r for r, left in self.loading.items() if left <= 1}
        self.loading = {r: left - 1 for r, left in self.loading.items() if left > 1}
        if self.fail:
            return self.output(failed_recving=dict.fromkeys(done, "toy failure"))
        return self.output(finished_recving=done, unverified=set() if self.verified else done)


@pytest.mark.parametrize("fail", [False, True])
def test_remote_kv_parks_the_request_until_it_lands(fail: bool) -> None:
    specs = {"l0": attn()}
    kv_config = make_kv_cache_config(specs, 10**7, 512)
    kv = KVCacheManager(kv_config, True, 512)
    connector = ToyRemoteConnector(num_external=40, delay_steps=2, fail=fail)
    scheduler = Scheduler(SchedulerConfig(SchedulerSettings(8, 64, reserve_growth_tokens=0), 512, frozenset()),
                          kv, connector)
    runner = ToyRunner(kv, scheduler.config)
    prompt = list(range(10, 50)) + [99]
    params = remote_prefill(len(prompt), toy_next_token(prompt))  # P sampled the first token: D continues from it
    request = Request("d", prompt, SamplingParams(max_tokens=3), kv_transfer_params=params)
    scheduler.add_request(request)
    statuses, computed_tokens = [], []
    while scheduler.has_work:
        so = scheduler.schedule()
        statuses.append(request.status)
        computed_tokens.append(so.num_scheduled_tokens.get("d"))
        out = runner.execute(so)
        out.kv_connector_output = connector.tick()
        scheduler.update_from_output(so, out)
    assert statuses[:2] == [RequestStatus.WAITING_FOR_REMOTE_KVS] * 2
    # landed: the one prompt token the connector did not load is computed here, plus P's
    # first token, without sampling it again; failed: the whole prompt
    assert next(c for c in computed_tokens if c) == (41 if fail else 2)
    assert request.output_token_ids == reference_outputs(prompt, 3)
    assert connector.finished_calls == ["d"] and kv.usage == 0.0
    assert scheduler.remote_kv.load_failures == {"recompute": int(fail), "fail": 0}


@pytest.mark.parametrize("verified", [True, False])
def test_remote_kv_not_verified_as_the_prompts_serves_its_request_but_enters_no_prefix_cache(verified) -> None:
    kv = KVCacheManager(make_kv_cache_config({"l0": attn()}, 10**7, 512), True, 512)
    connector = ToyRemoteConnector(num_external=40, delay_steps=1, verified=verified)
    scheduler = Scheduler(SchedulerConfig(SchedulerSettings(8, 64, reserve_growth_tokens=0), 512, frozenset()),
                          kv, connector)
    runner = ToyRunner(kv, scheduler.config)
    prompt = list(range(10, 50)) + [99]
    request = Request("d", prompt, SamplingParams(max_tokens=3),
                      kv_transfer_params=remote_prefill(len(prompt), toy_next_token(prompt)))
    scheduler.add_request(request)
    while scheduler.has_work:
        so = scheduler.schedule()
        out = runner.execute(so)
        out.kv_connector_output = connector.tick()
        scheduler.update_from_output(so, out)
    assert request.output_token_ids == reference_outputs(prompt, 3)
    _, hit = kv.get_computed_blocks(Request("again", prompt, SamplingParams(max_tokens=1)))
    assert hit == (32 if verified else 0)  # two full blocks of 16 (a hit leaves a token to compute)


def test_fail_policy_ends_a_request_whose_remote_kv_failed_with_an_error() -> None:
    kv_config = make_kv_cache_config({"l0": attn()}, 10**7, 512)
    kv = KVCacheManager(kv_config, True, 512)
    connector = ToyRemoteConnector(num_external=40, delay_steps=1, fail=True)
    config = SchedulerConfig(SchedulerSettings(8, 64, kv_load_failure_policy="fail", reserve_growth_tokens=0), 512,
                             frozenset())
    scheduler = Scheduler(config, kv, connector)
    runner = ToyRunner(kv, scheduler.config)
    remote = Request("d", list(range(10, 51)), SamplingParams(max_tokens=3), kv_transfer_params=remote_prefill(41))
    local = Request("c", list(range(60, 70)), SamplingParams(max_tokens=3))
    scheduler.add_request(remote)
    scheduler.add_request(local)
    outputs = []
    while scheduler.has_work:
        so = scheduler.schedule()
        assert "d" not in so.num_scheduled_tokens  # never computed here
        out = runner.execute(so)
        out.kv_connector_output = connector.tick()
        outputs += scheduler.update_from_output(so, out)
    failed, = [o for o in outputs if o.request_id == "d"]
    assert failed.finish_reason == "error" and "toy failure" in failed.error and failed.new_token_ids == []
    assert remote.status is RequestStatus.FINISHED_ERROR and remote.output_token_ids == []
    assert local.output_token_ids == reference_outputs(local.prompt_token_ids, 3)  # the others go on
    assert scheduler.remote_kv.load_failures == {"recompute": 0, "fail": 1}
    assert connector.finished_calls == ["d", "c"] and kv.usage == 0.0


def test_unknown_load_failure_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="recompute, fail"):
        SchedulerConfig(SchedulerSettings(8, 64, kv_load_failure_policy="retry"), 512)


class CountingRemoteConnector(ToyRemoteConnector):
    """A toy connector that remembers every load it was asked for."""

    def __init__(self, num_external: int, delay_steps: int) -> None:
        super().__init__(num_external, delay_steps)
        self.loads: list[str] = []

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.loads.append(request.request_id)
        super().update_state_after_alloc(request, blocks, num_external_tokens)


def run_with_connector(scheduler: Scheduler, kv: KVCacheManager, connector, runner=None) -> list:
    runner = runner or ToyRunner(kv, scheduler.config)
    outputs, steps = [], 0
    while scheduler.has_work:
        so = scheduler.schedule()
        out = runner.execute(so)
        out.kv_connector_output = connector.tick()
        outputs += scheduler.update_from_output(so, out)
        kv.check_integrity()
        steps += 1
        assert steps < 2_000, "scheduler made no progress"
    return outputs


def test_a_preempted_remote_prefill_request_is_recomputed_here_and_never_reread() -> None:
    """Once its KV has landed a request is local: preempting it frees its blocks, and it
    is recomputed from its own tokens (P freed its blocks after the read)."""
    kv_config = make_kv_cache_config({"l0": attn()}, 9 * 1024, 128)  # 8 usable blocks of 16 tokens
    kv = KVCacheManager(kv_config, True, 128)
    connector = CountingRemoteConnector(num_external=40, delay_steps=1)
    scheduler = Scheduler(SchedulerConfig(SchedulerSettings(8, 64, reserve_growth_tokens=0), 128, frozenset()),
                          kv, connector)
    prompts = [list(range(10, 51)), list(range(100, 141))]
    requests = [Request(f"d{i}", p, SamplingParams(max_tokens=40, ignore_eos=True),
                        kv_transfer_params=remote_prefill(len(p), toy_next_token(p))) for i, p in enumerate(prompts)]
    for request in requests:
        scheduler.add_request(request)
    run_with_connector(scheduler, kv, connector)
    assert scheduler.num_preemptions >= 1
    assert sorted(connector.loads) == ["d0", "d1"]  # one read each, none after a preemption
    for request, prompt in zip(requests, prompts):
        assert request.output_token_ids == reference_outputs(prompt, 40)
    assert kv.usage == 0.0


class FailingRunner(ToyRunner):
    """Raises (as a model would) in any batch holding `poison`, reporting the batch failed."""

    def __init__(self, kv, config, poison: int) -> None:
        super().__init__(kv, config)
        self.poison = poison

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = super().execute(so)
        bad = [r for r in so.num_scheduled_tokens if self.poison in self.tokens[r]]
        if bad:
            return ModelRunnerOutput(failed=dict.fromkeys(so.num_scheduled_tokens, "ValueError: poisoned"))
        return out


def test_a_failed_batch_fails_its_requests_and_the_scheduler_goes_on() -> None:
    scheduler, kv = make_scheduler({"l0": attn()}, 10**6, max_tokens_per_step=16)
    runner = FailingRunner(kv, scheduler.config, poison=666)
    poisoned = Request("bad", [666] + list(range(10, 40)), SamplingParams(max_tokens=4))
    later = Request("good", list(range(50, 60)), SamplingParams(max_tokens=4))  # waits: the budget is full
    scheduler.add_request(poisoned)
    scheduler.add_request(later)
    outputs = run_with_connector(scheduler, kv, ToyRemoteConnector(0, 1), runner)
    failed, = [o for o in outputs if o.request_id == "bad"]
    assert (failed.finish_reason, failed.error_code) == ("error", "internal_error") and "poisoned" in failed.error
    assert poisoned.status is RequestStatus.FINISHED_ERROR
    assert later.output_token_ids == reference_outputs(later.prompt_token_ids, 4)
    assert kv.usage == 0.0 and not scheduler.requests


class ExplodingConnector(ToyRemoteConnector):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id == "bad":
            raise KeyError("connector bug")
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


def test_a_fault_admitting_one_request_fails_that_request_alone() -> None:
    kv_config = make_kv_cache_config({"l0": attn()}, 10**6, 512)
    kv = KVCacheManager(kv_config, True, 512)
    connector = ExplodingConnector(0, 1)
    scheduler = Scheduler(SchedulerConfig(SchedulerSettings(8, 64, reserve_growth_tokens=0), 512, frozenset()),
                          kv, connector)
    bad, good = Request("bad", list(range(10, 30))), Request("good", list(range(30, 50)), SamplingParams(max_tokens=3))
    scheduler.add_request(bad)
    scheduler.add_request(good)
    outputs = run_with_connector(scheduler, kv, connector)
    failed, = [o for o in outputs if o.request_id == "bad"]
    assert failed.error_code == "internal_error" and "connector bug" in failed.error
    assert good.output_token_ids == reference_outputs(good.prompt_token_ids, 3) and kv.usage == 0.0


def run_with_a_latecomer(scheduler: Scheduler, kv: KVCacheManager, big: Request, small: Request,
                         arrive_at: int) -> dict[str, object]:
    """Step `big` alone, add `small` at step `arrive_at`, and step until `small` ends: the
    steps it took and the sequences preempted meanwhile."""
    runner = ToyRunner(kv, scheduler.config)
    preempted: list[str] = []
    preempt = scheduler._preempt
    scheduler._preempt = lambda request, out: (preempted.append(request.request_id), preempt(request, out))[1]
    scheduler.add_request(big)
    steps = 0
    while small.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
        if steps == arrive_at:
            scheduler.add_request(small)
        so = scheduler.schedule()
        scheduler.update_from_output(so, runner.execute(so))
        kv.check_integrity()
        steps += 1
        assert steps < 5_000, "the small request never ended"
    return {"steps": steps - arrive_at, "preempted": preempted, "big_running": len(scheduler.running)}


@pytest.mark.parametrize("memory_blocks", [2000, 60])  # room for every sequence; far too little
def test_one_requests_sequences_cannot_starve_another_request(memory_blocks: int) -> None:
    """Issue 31 row 4: a request with n = 128 took every slot of the batch (and, as its
    sequences grew, the pool: the small request was preempted again and again); a
    4-token request behind it waited for it. Now the small one runs at once, and only
    the big one's sequences are preempted."""
    specs = {"l0": attn()}
    page = make_kv_cache_config(specs, 10**9).cross_layer_page_bytes
    scheduler, kv = make_scheduler(specs, memory_blocks * page, max_num_seqs=8)
    big = Request("big", list(range(10, 50)), SamplingParams(max_tokens=400, n=32, ignore_eos=True, temperature=1.0))
    small = Request("small", list(range(60, 80)), SamplingParams(max_tokens=4, ignore_eos=True))
    seen = run_with_a_latecomer(scheduler, kv, big, small, arrive_at=30)
    assert small.output_token_ids == reference_outputs(small.prompt_token_ids, 4)
    assert seen["steps"] <= 6  # admitted at its first step: its prefill and 3 decode steps, a step of slack
    assert "small" not in seen["preempted"]
    assert seen["big_running"] == 7  # the big one goes on (the small one left a slot this step)


def test_a_step_computes_no_more_of_one_requests_sequences_than_of_any_others() -> None:
    """Probe finding 4: beside a request of n = 128 running 64 sequences a step, a 4-token
    request's steps took the time of the big one's batch (p99 1.75-2.6x). While the small
    one waits or runs, a step computes one sequence of the big one (the most the small one
    runs), those computed least recently first; alone, all of them."""
    specs = {"l0": attn()}
    page = make_kv_cache_config(specs, 10**9).cross_layer_page_bytes
    scheduler, kv = make_scheduler(specs, 4000 * page, max_num_seqs=16)
    big = Request("big", list(range(10, 50)), SamplingParams(max_tokens=400, n=16, ignore_eos=True, temperature=1.0))
    small = Request("small", list(range(60, 80)), SamplingParams(max_tokens=4, ignore_eos=True))
    runner, steps = ToyRunner(kv, scheduler.config), []
    scheduler.add_request(big)
    while small.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
        if len(steps) == 10:
            scheduler.add_request(small)
        so = scheduler.schedule()
        steps.append(sorted(so.num_scheduled_tokens))
        scheduler.update_from_output(so, runner.execute(so))
        assert len(steps) < 100, "the small request never ended"
    alone, beside = steps[2:10], steps[10:]
    assert all(len(ids) == 16 for ids in alone)  # every sequence of the big one, once forked
    assert all("small" in ids and len(ids) == 2 for ids in beside), beside  # the small one and one of big's
    assert len(beside) == 4  # its prefill and 3 decode steps: as beside a request of one sequence
    assert len({i for ids in beside for i in ids} - {"small"}) == 4  # four sequences of big's in turn
    assert small.output_token_ids == reference_outputs(small.prompt_token_ids, 4)


@pytest.mark.parametrize("reserve", [0, 128])
def test_admission_keeps_room_for_what_running_requests_will_grow_into(reserve: int) -> None:
    """Issue 31 row 7: with a cache for ~1.6 requests, each admitted next to another was
    preempted as both grew and recomputed (a burst did its work twice). Reserving room
    for the next tokens of every request holding blocks admits it when it can finish."""
    specs = {"l0": attn()}
    page = make_kv_cache_config(specs, 10**9).cross_layer_page_bytes
    kv_config = make_kv_cache_config(specs, 40 * page, 512)
    kv = KVCacheManager(kv_config, True, 512)
    config = SchedulerConfig(SchedulerSettings(8, 64, reserve_growth_tokens=reserve), 512, frozenset({EOS}))
    scheduler = Scheduler(config, kv, NullConnectorScheduler())
    requests = [Request(f"r{i}", [10 + i] * 300, SamplingParams(max_tokens=100, ignore_eos=True)) for i in range(4)]
    seen = run_all(scheduler, kv, requests)
    assert all(r.output_token_ids == reference_outputs(r.prompt_token_ids, 100) for r in requests)
    assert (seen["preemptions"] == 0) == (reserve > 0), seen
