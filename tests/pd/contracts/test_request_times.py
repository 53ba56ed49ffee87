"""`RequestTimes`: the engine stamps a request's arrival, first step, first token and end
(in that order, each once), and only its finishing output carries them."""

from __future__ import annotations

from pd.config import SchedulerConfig, SchedulerSettings
from pd.contracts.connector_api import NullConnectorScheduler
from pd.contracts.outputs import ModelRunnerOutput
from pd.contracts.request import Request
from pd.contracts.sampling_params import SamplingParams
from pd.kv_cache.kv_cache_manager import KVCacheManager
from pd.kv_cache.layout import make_kv_cache_config
from pd.kv_cache.spec import FullAttentionSpec
from pd.scheduling.scheduler import Scheduler

EOS, BLOCK = 2, 4


def test_a_chunked_request_is_stamped_once_per_point_and_its_last_output_carries_the_times() -> None:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype="float32")
    kv = KVCacheManager(make_kv_cache_config({"l0": spec}, 10**6, 64), True, 64)
    scheduler = Scheduler(SchedulerConfig(SchedulerSettings(4, 8, reserve_growth_tokens=0), 64, frozenset({EOS})), kv,
                          NullConnectorScheduler())
    request = Request("r", list(range(10, 30)), SamplingParams(max_tokens=3))  # 20 tokens: 3 chunks of 8
    scheduler.add_request(request)
    seen, outputs = [], []
    while scheduler.has_unfinished_requests:
        so = scheduler.schedule()
        seen.append((request.times.scheduled, request.times.first_token))
        done = request.num_computed_tokens + so.num_scheduled_tokens["r"] == request.num_tokens
        outputs += scheduler.update_from_output(so, ModelRunnerOutput({"r": 42} if done else {}))
    times = request.times
    assert times.arrival <= times.scheduled <= times.first_token <= times.finished
    assert len({s for s, _ in seen}) == 1  # the first step's time, kept through the later chunks
    assert [o.times is not None for o in outputs] == [False, False, True] and outputs[-1].times == times
    assert (times.kv_wait, times.kv_landed, times.kv_tokens) == (None, None, 0)
