"""The step budget (--max-step-ms): a step's prompt tokens beside running decodes are
bounded by what the learnt cost says fits the limit; outputs are unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from pd.config import SchedulerConfig, SchedulerSettings
from pd.contracts.connector_api import NullConnectorScheduler
from pd.contracts.request import Request, RequestStatus
from pd.contracts.sampling_params import SamplingParams
from pd.kv_cache.kv_cache_manager import KVCacheManager
from pd.kv_cache.layout import make_kv_cache_config
from pd.scheduling.scheduler import Scheduler
from pd.scheduling.step_budget import AUTO_FACTOR, MIN_CHUNK, REFIT_EVERY, StepBudget, fitted_cost
from tests.support.toy_scheduler import EOS, ToyRunner, attn, reference_outputs

BASE, PER_DECODE, PER_TOKEN = 0.010, 0.001, 0.0005  # a made-up machine's step cost, seconds


def step_seconds(decodes: int, prompt_tokens: int) -> float:
    return BASE + PER_DECODE * decodes + PER_TOKEN * prompt_tokens


def test_the_fit_recovers_a_steps_cost_and_waits_until_a_prompt_tokens_cost_is_known() -> None:
    rng = np.random.default_rng(0)
    rows = [(d, p, step_seconds(d, p)) for d, p in zip(rng.integers(0, 9, 64), rng.integers(0, 600, 64))]
    assert fitted_cost(np.array(rows)) == pytest.approx((BASE, PER_DECODE, PER_TOKEN))
    same_prompt = [(d, 64, step_seconds(d, 64)) for d in range(1, 9)]
    assert fitted_cost(np.array(same_prompt)) is None
    falling = [(1, p, 0.05 - 0.0001 * p) for p in (0, 100, 200)]  # no positive cost per token
    assert fitted_cost(np.array(falling)) is None


def learnt(budget: StepBudget) -> StepBudget:
    for i in range(REFIT_EVERY):
        decodes, prompt = 1 + i % 8, 100 * (i % 3)
        budget.planned([1] * decodes + ([prompt] if prompt else []))
        budget.took(step_seconds(decodes, prompt))
    return budget


def test_a_limit_in_milliseconds_bounds_the_prompt_tokens_beside_decodes() -> None:
    budget = StepBudget(1024, 30.0)
    assert budget.prompt_tokens(4) == 1020, "nothing learnt yet: no limit"
    learnt(budget)
    assert budget.cost == pytest.approx((BASE, PER_DECODE, PER_TOKEN))
    assert budget.prompt_tokens(4) == pytest.approx((0.030 - step_seconds(4, 0)) / PER_TOKEN, abs=1)  # 32
    assert budget.prompt_tokens(0) == 1024, "no stream to stall"
    assert budget.prompt_tokens(20) == MIN_CHUNK, "decodes alone past the limit: prefills still go on"
    assert StepBudget(1024, 500.0).prompt_tokens(4) == 1020


def test_auto_gives_a_prefill_the_decodes_own_time_and_off_never_limits() -> None:
    auto = learnt(StepBudget(1024, "auto"))
    alone = step_seconds(8, 0)
    assert auto.prompt_tokens(8) == pytest.approx((AUTO_FACTOR - 1) * alone / PER_TOKEN, abs=1)  # 36
    off = learnt(StepBudget(1024, "off"))
    assert off.cost is None and off.prompt_tokens(8) == 1016


def make_scheduler(max_step_ms: float | str) -> tuple[Scheduler, KVCacheManager]:
    kv_config = make_kv_cache_config({"l0": attn()}, 10**7, 2048)
    kv = KVCacheManager(kv_config, True, 2048)
    settings = SchedulerSettings(max_num_seqs=16, max_num_batched_tokens=1024, max_step_ms=max_step_ms,
                                 reserve_growth_tokens=0)
    return Scheduler(SchedulerConfig(settings, 2048, frozenset({EOS})), kv, NullConnectorScheduler()), kv


def run(scheduler: Scheduler, kv: KVCacheManager, requests: list[Request],
        arrivals: dict[int, list[Request]]) -> list[tuple[int, int]]:
    """Step to the end on the made-up machine's clock; (decodes, prompt tokens) of each step."""
    runner = ToyRunner(kv, scheduler.config)
    steps = []
    for r in requests:
        scheduler.add_request(r)
    while scheduler.has_unfinished_requests or arrivals:
        for r in arrivals.pop(len(steps), []):
            scheduler.add_request(r)
        so = scheduler.schedule()
        scheduler.update_from_output(so, runner.execute(so))
        counts = list(so.num_scheduled_tokens.values())
        steps.append((counts.count(1), sum(n for n in counts if n > 1)))
        scheduler.step_budget.took(step_seconds(*steps[-1]))
        assert len(steps) < 5_000
    assert kv.usage == 0.0
    return steps


@pytest.mark.parametrize("max_step_ms", [40.0, "off"])
def test_prefills_arriving_among_streams_keep_each_step_within_the_limit(max_step_ms: float | str) -> None:
    """Eight streams decode while long prompts keep arriving: with a limit, once the cost
    is learnt no step that carries decodes is predicted past 40 ms (or takes more than
    MIN_CHUNK prompt tokens); every stream gets a token every step, and outputs are the
    reference's. Without one (as before), chunks of up to 1024 tokens stall the streams."""
    streams = [Request(f"s{i}", [10 + i] * 8, SamplingParams(max_tokens=300, temperature=0)) for i in range(8)]
    rng = np.random.default_rng(1)  # prompts with no prefix in common
    late = {20 + 12 * i: [Request(f"p{i}", rng.integers(10, 500, 700).tolist(), SamplingParams(max_tokens=4))]
            for i in range(8)}
    every = list(streams) + [r for rs in late.values() for r in rs]
    scheduler, kv = make_scheduler(max_step_ms)
    steps = run(scheduler, kv, streams, late)
    for r in every:
        assert r.status is RequestStatus.FINISHED_LENGTH_CAPPED
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.sampling_params.max_tokens)
    assert all(d >= 8 for d, _ in steps[1:290]), "a stream missed a step"
    with_decodes = [(d, p) for d, p in steps[REFIT_EVERY * 2:] if d >= 8]
    assert with_decodes and any(p for _, p in with_decodes)
    longest = max(step_seconds(d, p) for d, p in with_decodes if p > MIN_CHUNK or max_step_ms == "off")
    if max_step_ms == "off":
        assert longest > 0.3, "1024-token chunks beside the streams"
    else:
        assert longest <= 0.040 + PER_TOKEN


def test_prompts_as_many_as_the_decodes_take_the_whole_budget() -> None:
    budget = learnt(StepBudget(1024, 40.0))
    limited = int((0.040 - step_seconds(4, 0)) / PER_TOKEN)
    assert budget.prompt_tokens(4, 3) == limited, "fewer prompts than streams: bounded"
    assert budget.prompt_tokens(4, 4) == 1020, "as many: the streams delayed are not the more"
    assert budget.prompt_tokens(4, 9) == 1020


def test_prompts_arriving_beside_fewer_streams_start_together() -> None:
    """One stream decodes when seven prompts arrive: the next step computes all seven (the
    one stream waits once) and all eight decode together after, rather than the prompts
    trickling in at the limit's ~58 tokens a step while the batch stays short."""
    scheduler, kv = make_scheduler(40.0)
    learnt(scheduler.step_budget)
    stream = Request("s", [10] * 8, SamplingParams(max_tokens=60, temperature=0))
    rng = np.random.default_rng(2)
    prompts = [Request(f"p{i}", rng.integers(10, 500, 140).tolist(), SamplingParams(max_tokens=20, temperature=0))
               for i in range(7)]
    steps = run(scheduler, kv, [stream], {5: prompts})
    assert steps[5] == (1, 7 * 140)
    assert all(d == 8 for d, _ in steps[6:25])
    for r in [stream, *prompts]:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.sampling_params.max_tokens)


def test_only_waiting_prompts_the_batch_has_room_for_count_against_the_streams() -> None:
    """Fourteen streams of at most sixteen decode when twenty prompts arrive: only two can
    start, so the prompts are fewer than the streams and the step stays within the limit."""
    scheduler, kv = make_scheduler(40.0)
    learnt(scheduler.step_budget)
    streams = [Request(f"s{i}", [10 + i] * 8, SamplingParams(max_tokens=40, temperature=0)) for i in range(14)]
    rng = np.random.default_rng(3)
    prompts = [Request(f"p{i}", rng.integers(10, 500, 300).tolist(), SamplingParams(max_tokens=4, temperature=0))
               for i in range(20)]
    steps = run(scheduler, kv, streams, {5: prompts})
    decodes, prompt_tokens = steps[5]
    assert decodes == 14 and 0 < prompt_tokens <= max(MIN_CHUNK, (0.040 - step_seconds(14, 0)) / PER_TOKEN)
