"""The planner's predictions (planner/model.py) against queueing facts they must hold."""

from __future__ import annotations

import math

import pytest

from planner.model import OVERLOADED, Costs, Load, predict

COSTS = Costs(prefill_tokens_per_s=1000.0, decode_step_s=0.02, decode_step_per_seq_s=0.002, transfer_s=0.01)


def test_an_idle_fleet_answers_in_its_service_times() -> None:
    p = predict(1, 1, Load(0.0, 500, 50), COSTS, 0.9)
    assert p.ttft_s == pytest.approx(0.5 + 0.01)  # its own prompt, then the KV read
    assert p.tpot_s == pytest.approx(0.02)


def test_ttft_grows_with_utilization_and_is_infinite_past_capacity() -> None:
    ttfts = [predict(1, 1, Load(rate, 500, 50), COSTS, 0.9).ttft_s for rate in (0.1, 1.0, 1.5, 1.9, 2.0, 3.0)]
    assert ttfts == sorted(ttfts) and ttfts[0] == pytest.approx(0.51)  # rho 0.05 < 0.1: no wait at p90
    assert math.isinf(ttfts[-2]) and math.isinf(ttfts[-1])
    # M/M/1 at rho 0.95 on the pooled rate (2 tokens per ms, 500-token prompts): p90 waiting
    # = ln(0.95 / 0.1) / ((1 - 0.95) x 2000 / 500)
    two = predict(2, 1, Load(3.8, 500, 50), COSTS, 0.9)
    assert two.ttft_s == pytest.approx(math.log(9.5) / (0.05 * 4) + 0.5 + 0.01)
    assert two.prefill_utilization == pytest.approx(0.95)


def test_a_backlog_left_by_a_burst_is_waited_for() -> None:
    calm = predict(2, 1, Load(0.5, 500, 50), COSTS, 0.9)
    after_burst = predict(2, 1, Load(0.5, 500, 50, queued_prompt_tokens=8000), COSTS, 0.9)
    assert after_burst.ttft_s == pytest.approx(8000 / 2000 + 0.51) and after_burst.ttft_s > calm.ttft_s


def test_tpot_is_littles_fixed_point_and_the_running_batch_bounds_it() -> None:
    load = Load(5.0, 100, 100)  # 500 sequences' tokens per second
    p = predict(1, 2, load, COSTS, 0.9)
    demand = 0.002 * 5.0 * 100 / 2
    assert p.tpot_s == pytest.approx(0.02 / (1 - demand)) and p.decode_utilization == pytest.approx(demand)
    assert p.decode_batch == pytest.approx(5.0 * 100 * p.tpot_s / 2)
    busy = predict(1, 2, Load(5.0, 100, 100, running_decodes=60), COSTS, 0.9)
    assert busy.tpot_s == pytest.approx(0.02 + 0.002 * 30)
    assert math.isinf(predict(1, 1, Load(5.0, 100, 100), COSTS, 0.9).tpot_s)  # demand 1: it cannot keep up


def test_the_score_ranks_splits_that_cannot_keep_up_by_how_far_they_are() -> None:
    load = Load(3.0, 500, 100)
    one, two = predict(1, 2, load, COSTS, 0.9), predict(2, 1, load, COSTS, 0.9)
    assert one.score(1.0, 0.05) == OVERLOADED * 1.5  # the prefill pool at 150 %
    assert two.score(1.0, 0.05) < one.score(1.0, 0.05)
    assert predict(2, 1, Load(0.2, 500, 10), COSTS, 0.9).score(1.0, 0.05) < 1
