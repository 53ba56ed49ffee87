"""Requests arriving together with a prompt prefix that is not cached yet: the first
computes it, the others wait a step and find it cached (their outputs unchanged)."""

from __future__ import annotations

import random

from pd.config import SchedulerConfig, SchedulerSettings
from pd.contracts.connector_api import NullConnectorScheduler
from pd.contracts.request import Request
from pd.contracts.sampling_params import SamplingParams
from pd.kv_cache.kv_cache_manager import KVCacheManager
from pd.kv_cache.layout import make_kv_cache_config
from pd.scheduling import fair_share
from pd.scheduling.prefix_wait import SHARED_BLOCKS_TO_WAIT
from pd.scheduling.scheduler import Scheduler
from tests.support.toy_scheduler import BLOCK, EOS, MODELS, ToyRunner, reference_outputs


def make_scheduler(model: str = "full", caching: bool = True) -> tuple[Scheduler, KVCacheManager]:
    specs = {f"l{i}": s for i, s in enumerate(MODELS[model])}
    kv = KVCacheManager(make_kv_cache_config(specs, 10**8, 1024), caching, 1024)
    settings = SchedulerSettings(max_num_seqs=16, max_num_batched_tokens=2048, reserve_growth_tokens=0)
    return Scheduler(SchedulerConfig(settings, 1024, frozenset({EOS})), kv, NullConnectorScheduler()), kv


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 500) for _ in range(n)]


def run(scheduler: Scheduler, kv: KVCacheManager, requests: list[Request]) -> list[dict[str, int]]:
    """Every step's scheduled tokens, per request."""
    runner = ToyRunner(kv, scheduler.config)
    for r in requests:
        scheduler.add_request(r)
    steps = []
    while scheduler.has_unfinished_requests:
        so = scheduler.schedule()
        scheduler.update_from_output(so, runner.execute(so))
        steps.append(dict(so.num_scheduled_tokens))
        assert len(steps) < 1000
    assert kv.usage == 0.0
    for r in requests:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.sampling_params.max_tokens)
    return steps


def test_a_burst_with_one_new_prefix_computes_it_once() -> None:
    """Six requests, two 160-token prefixes, 40 tokens of their own: step 1 computes each
    prefix once (r0 and r1), the four sharing them start a step later with a hit."""
    rng = random.Random(0)
    prefixes = [tokens(rng, 10 * BLOCK), tokens(rng, 10 * BLOCK)]
    requests = [Request(f"r{i}", prefixes[i % 2] + tokens(rng, 40), SamplingParams(max_tokens=5, temperature=0))
                for i in range(6)]
    scheduler, kv = make_scheduler()
    steps = run(scheduler, kv, requests)
    assert steps[0] == {"r0": 200, "r1": 200}
    assert steps[1] == {"r0": 1, "r1": 1} | {f"r{i}": 40 for i in range(2, 6)}
    assert sum(n for step in steps for n in step.values() if n > 1) == 2 * 200 + 4 * 40


def test_without_a_prefix_cache_nothing_waits() -> None:
    rng = random.Random(4)
    prefix = tokens(rng, 8 * BLOCK)
    requests = [Request(f"r{i}", prefix + tokens(rng, 20), SamplingParams(max_tokens=3, temperature=0))
                for i in range(3)]
    scheduler, kv = make_scheduler(caching=False)
    assert set(run(scheduler, kv, requests)[0]) == {"r0", "r1", "r2"}


def test_a_request_sharing_under_the_threshold_does_not_wait() -> None:
    rng = random.Random(1)
    common = tokens(rng, SHARED_BLOCKS_TO_WAIT * BLOCK - 1)  # one full block short
    requests = [Request(f"r{i}", common + tokens(rng, 60), SamplingParams(max_tokens=3, temperature=0))
                for i in range(2)]
    scheduler, kv = make_scheduler()
    steps = run(scheduler, kv, requests)
    assert set(steps[0]) == {"r0", "r1"}


def test_a_request_scoring_its_prompt_computes_every_token_and_never_waits() -> None:
    rng = random.Random(2)
    prefix = tokens(rng, 8 * BLOCK)
    scored = Request("s", prefix + tokens(rng, 10), SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))
    plain = Request("p", prefix + tokens(rng, 10), SamplingParams(max_tokens=2, temperature=0))
    scheduler, kv = make_scheduler()
    steps = run(scheduler, kv, [plain, scored])
    assert steps[0] == {"p": len(plain.prompt_token_ids), "s": len(scored.prompt_token_ids)}


def test_hybrid_models_wait_for_a_shared_prefix_too() -> None:
    """Sliding-window and Mamba groups: the waiting request's outputs are the reference's
    and it starts after the first (what its hit covers is the hybrid hit search's)."""
    for model in sorted(MODELS):
        rng = random.Random(3)
        prefix = tokens(rng, 12 * BLOCK)
        requests = [Request(f"r{i}", prefix + tokens(rng, 30), SamplingParams(max_tokens=4, temperature=0))
                    for i in range(3)]
        scheduler, kv = make_scheduler(model)
        steps = run(scheduler, kv, requests)
        assert set(steps[0]) == {"r0"}, model


def test_a_queue_waiting_for_one_prefix_is_walked_once_a_step(monkeypatch) -> None:
    """300 requests arriving together behind one 160-token prefix: the first computes it,
    the others wait; finding that walks the queue a few times a step, not once per waiting
    request (fair share's key, a request's group, is looked up a few times per request, not
    ~150 times on average)."""
    rng = random.Random(5)
    prefix = tokens(rng, 10 * BLOCK)
    requests = [Request(f"r{i}", prefix + tokens(rng, 8), SamplingParams(max_tokens=1, temperature=0))
                for i in range(300)]
    scheduler, kv = make_scheduler()
    for r in requests:
        scheduler.add_request(r)
    lookups = []
    real_group = fair_share.group
    monkeypatch.setattr(fair_share, "group", lambda r: lookups.append(r) or real_group(r))
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"r0": 168}
    assert len(lookups) < 10 * len(requests)
