"""pd bench simulate: the engine model's steps, the fleet's timings against hand-worked
figures, queueing against M/D/1, the real planner switching on a phase change,
determinism, the cost fit, and the CLI end to end on a tiny costs file."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import numpy as np
import pytest

from benchmarks import simulate
from benchmarks.datasets import read_trace
from benchmarks.fleet import Phase
from benchmarks.sim import fit, trace
from benchmarks.sim.costs import StepCosts, attention_of
from benchmarks.sim.engine import Job, SimEngine, Work
from benchmarks.sim.fleet import SimRequest
from benchmarks.sim.planning import metrics_text
from planner.model import Load, predict
from planner.observe import server_counters

# 10 ms a step plus 1 ms a token: nothing else, so every figure below can be worked by hand
SIMPLE = StepCosts(fixed_s=0.01, per_token_s=0.001, per_attention_s=0.0, per_sample_s=0.0, kv_bytes_per_token=1000.0,
                   transfer_bytes_per_s=1e6, transfer_fixed_s=0.002, max_num_batched_tokens=1024)


def args_for(servers: int, **more) -> argparse.Namespace:
    base = {"servers": servers, "ttft_slo": 2.0, "tpot_slo": 0.1, "request_timeout": 300.0, "switch_delay": 0.0,
            "planner_args": "--interval 1 --patience 2 --cooldown 5"}
    return argparse.Namespace(**(base | more))


def one_run(config: str, requests: list[SimRequest], servers: int, costs: StepCosts = SIMPLE, **more) -> dict:
    return simulate.simulate(config, requests, costs, args_for(servers, **more))


def test_a_colocated_request_alone_takes_its_steps_exactly() -> None:
    out = one_run("colocated", [SimRequest(1.0, 100, 3, "p")], 1)
    record = out["records"][0]
    assert record.ttft == pytest.approx(0.01 + 0.100)  # one step computing the prompt, sampling the first token
    assert record.tpot == pytest.approx(0.01 + 0.001)  # then one decode token a step
    assert record.end == pytest.approx(1.0 + 0.110 + 2 * 0.011)


def test_a_disaggregated_request_pays_the_prefill_the_read_and_then_decode_steps() -> None:
    out = one_run("1p1d", [SimRequest(0.0, 500, 4, "p")], 2)
    record = out["records"][0]
    read = 0.002 + 500 * 1000 / 1e6
    assert record.ttft == pytest.approx(0.01 + 0.5 + read)  # P's token goes out once D has read the KV
    assert record.tpot == pytest.approx(0.011)


def test_a_read_that_lands_while_d_steps_sends_its_first_token_at_the_steps_end() -> None:
    """D hears of a finished read from its step's connector output: B's first token goes
    out at the end of one of the decode steps A is in, after the prefill and the read."""
    out = one_run("1p1d", [SimRequest(0.0, 10, 400, "a"), SimRequest(1.0, 500, 4, "b")], 2)
    a, b = out["records"]
    first_b = b.start + b.ttft
    assert first_b > 1.0 + 0.51 + 0.002 + 0.5
    steps = (first_b - (a.start + a.ttft)) / 0.011  # A's tokens come one a step of 11 ms, D idle otherwise
    assert steps == pytest.approx(round(steps), abs=1e-6)


@pytest.mark.parametrize("polls", [1, 2, 3])
def test_a_busy_decode_server_hears_of_a_read_at_its_transfer_polls_th_step_end(polls: int) -> None:
    """B's bytes are in during one of A's 11 ms decode steps; D polls the read once at each
    step end, and B's first token goes out at the `polls`-th (the connector's data read,
    then the lease word's, `connectors/nixl/worker.py`)."""
    costs = replace(SIMPLE, transfer_polls=polls)
    out = one_run("1p1d", [SimRequest(0.0, 10, 400, "a"), SimRequest(1.0, 500, 4, "b")], 2, costs)
    a, b = out["records"]
    bytes_in = 1.0 + 0.51 + 0.002 + 0.5  # P's prefill, then the read
    first_a = a.start + a.ttft
    step_ends = [first_a + 0.011 * k for k in range(1, 400)]
    heard = [t for t in step_ends if t > bytes_in + 1e-9][polls - 1]
    assert b.start + b.ttft == pytest.approx(heard)


def test_an_idle_decode_server_hears_of_a_read_at_once_whatever_its_polls() -> None:
    out = one_run("1p1d", [SimRequest(0.0, 500, 4, "p")], 2, replace(SIMPLE, transfer_polls=3))
    assert out["records"][0].ttft == pytest.approx(0.01 + 0.5 + 0.002 + 500 * 1000 / 1e6)


def test_on_one_host_a_step_beside_another_engines_takes_the_corun_factor() -> None:
    """Two colocated servers of one host: a prompt arriving while the other server steps is
    computed corun_factor x slower; with a host each, or the other idle, it is not."""
    costs = replace(SIMPLE, corun_factor=1.5)
    requests = [SimRequest(0.0, 10, 200, "busy"), SimRequest(0.5, 100, 1, "beside")]
    shared = one_run("colocated", requests, 2, costs, one_host=True, policy="round_robin")["records"]
    apart = one_run("colocated", requests, 2, costs, policy="round_robin")["records"]
    assert apart[1].ttft == pytest.approx(0.11)
    assert shared[1].ttft == pytest.approx(0.11 * 1.5)
    assert shared[0].ttft == pytest.approx(0.02)  # alone on the host when it started


def test_a_long_prompt_is_computed_in_budget_sized_chunks_beside_running_decodes() -> None:
    engine = SimEngine(SIMPLE)
    decoding = Job("d", Work.LOCAL, 10, 50)
    engine.add(decoding)
    engine.schedule()
    engine.finish()
    engine.add(Job("p", Work.LOCAL, 2500, 1))
    step = engine.schedule()
    assert [(job.request, n) for job, n in step.scheduled] == [("d", 1), ("p", 1023)]
    assert step.seconds == pytest.approx(0.01 + 0.001 * 1024)
    engine.finish()
    step = engine.schedule()
    assert [n for _, n in step.scheduled] == [1, 1023]
    engine.finish()
    step = engine.schedule()
    assert [n for _, n in step.scheduled] == [1, 454]
    tokens = engine.finish()
    assert [(t.job.request, t.finished) for t in tokens] == [("d", False), ("p", True)]
    assert engine.counters.computed == 10 + 2500


def real_and_simulated_steps(costs: StepCosts, arrivals: list[tuple[float, int, int]]) -> tuple[list, list]:
    """The same arrivals (time, prompt tokens, output tokens) stepped by the real Scheduler
    (its StepBudget included, a toy runner computing) and by SimEngine, each step taking
    the costs' time of what it computes: per step, the (request, tokens) it scheduled."""
    from pd.config import SchedulerConfig, SchedulerSettings
    from pd.contracts.connector_api import NullConnectorScheduler
    from pd.contracts.request import Request
    from pd.contracts.sampling_params import SamplingParams
    from pd.kv_cache.kv_cache_manager import KVCacheManager
    from pd.kv_cache.layout import make_kv_cache_config
    from pd.scheduling.scheduler import Scheduler
    from tests.support.toy_scheduler import EOS, ToyRunner, attn

    rng = np.random.default_rng(0)
    kv = KVCacheManager(make_kv_cache_config({"l0": attn()}, 10**8, 16384), True, 16384)
    settings = SchedulerSettings(max_num_seqs=costs.max_num_seqs, max_num_batched_tokens=costs.max_num_batched_tokens,
                                 max_step_ms=costs.max_step_ms, reserve_growth_tokens=0)
    scheduler = Scheduler(SchedulerConfig(settings, 16384, frozenset({EOS})), kv, NullConnectorScheduler())
    runner = ToyRunner(kv, scheduler.config)
    requests = [(at, Request(f"r{k}", rng.integers(10, 500, prompt).tolist(),
                             SamplingParams(max_tokens=outputs, temperature=0, ignore_eos=True)))
                for k, (at, prompt, outputs) in enumerate(arrivals)]
    real, simulated = [], []

    def real_step() -> float:
        out = scheduler.schedule()
        result = runner.execute(out)
        seconds = costs.step_s(out.total_num_scheduled_tokens, 0.0, len(result.sampled_token_ids))
        scheduler.update_from_output(out, result)
        scheduler.step_budget.took(seconds)
        real.append(sorted(out.num_scheduled_tokens.items()))
        return seconds

    replay(requests, scheduler.add_request, lambda: scheduler.has_unfinished_requests, real_step)
    engine = SimEngine(costs)

    def simulated_step() -> float:
        step = engine.schedule()
        simulated.append(sorted((job.request, n) for job, n in step.scheduled))
        engine.finish()
        return step.seconds

    jobs = [(at, Job(f"r{k}", Work.LOCAL, prompt, outputs)) for k, (at, prompt, outputs) in enumerate(arrivals)]
    replay(jobs, engine.add, lambda: engine.has_compute_work, simulated_step)
    return real, simulated


def replay(arrivals: list[tuple[float, object]], add, busy, step) -> None:
    """Each (time, request) added once the clock reaches it; while `busy()`, `step()`
    moves the clock on by the seconds it returns, else the clock jumps to the next arrival."""
    pending, now = list(arrivals), 0.0
    while pending or busy():
        while pending and pending[0][0] <= now:
            add(pending.pop(0)[1])
        if busy():
            now += step()
        else:
            now = pending[0][0]


@pytest.mark.parametrize("max_step_ms", ["auto", 60.0, "off"])
def test_the_engine_model_schedules_every_step_as_the_real_scheduler_does(max_step_ms) -> None:
    """Streams decoding while prompts of every length arrive, alone and in bursts: the
    step budget (step_budget.py) bounds the chunks beside the decodes, lets a majority of
    prompts take the whole budget, and learns the step's cost from the steps' times; the
    model must take the same steps, token for token."""
    costs = StepCosts(fixed_s=0.0113, per_token_s=4.8e-4, per_attention_s=0.0, per_sample_s=8e-4,
                      kv_bytes_per_token=0.0, transfer_bytes_per_s=1e9, max_num_seqs=16, max_step_ms=max_step_ms)
    rng = np.random.default_rng(5)
    times = np.cumsum(rng.exponential(0.25, 60))
    times[20:28] = times[20]  # a burst of 8
    arrivals = [(float(t), int(rng.integers(20, 3000)), int(rng.integers(1, 80))) for t in times]
    real, simulated = real_and_simulated_steps(costs, arrivals)
    assert simulated == real
    largest_beside_decodes = max(sum(n for _, n in step if n > 1) for step in real if any(n == 1 for _, n in step))
    if max_step_ms == "off":
        assert largest_beside_decodes == costs.max_num_batched_tokens - 1
    else:  # bounded once the cost is learnt, and the burst takes the whole budget
        assert largest_beside_decodes > 1000
        assert any(0 < sum(n for _, n in step if n > 1) < 100 for step in real)


def test_attention_counts_each_new_token_against_what_precedes_it() -> None:
    assert attention_of(1, 99) == 100  # a decode token over its context and itself
    assert attention_of(4, 0) == 1 + 2 + 3 + 4


def test_poisson_arrivals_on_one_server_queue_as_m_d_1_says() -> None:
    """Prompts of exactly the step budget, one token answers: each request is one step of
    service time S, so one server is an M/D/1 queue whose mean wait is rho S / (2 (1 - rho))."""
    service = 0.01 + 1.024
    rho, n = 0.8, 4000
    times = np.cumsum(np.random.default_rng(7).exponential(service / rho, n))
    out = one_run("colocated", [SimRequest(float(t), 1024, 1, "p") for t in times], 1)
    waits = [r.ttft - service for r in out["records"]]
    assert np.mean(waits) == pytest.approx(rho * service / (2 * (1 - rho)), rel=0.1)
    assert min(waits) == pytest.approx(0.0, abs=1e-9)


def test_the_planner_moves_a_server_to_prefill_and_back_as_the_load_changes_phase() -> None:
    costs = StepCosts(fixed_s=0.01, per_token_s=0.001, per_attention_s=0.0, per_sample_s=0.0, kv_bytes_per_token=0.0,
                      transfer_bytes_per_s=1e9)
    rng = np.random.default_rng(1)
    long = [SimRequest(float(t), 1000, 4, "long") for t in np.cumsum(rng.exponential(1 / 1.4, 60))]
    start = long[-1].arrival + 1
    chat = [SimRequest(start + float(t), 20, 200, "chat") for t in np.cumsum(rng.exponential(1 / 4.0, 240))]
    out = one_run("planner", long + chat, 3, costs, ttft_slo=3.0, tpot_slo=0.03)
    roles = [s["role"] for s in out["switches"]]
    assert roles[:1] == ["prefill"] and "decode" in roles  # 1P2D -> 2P1D under long prompts, back for chat
    first_back = next(s for s in out["switches"] if s["role"] == "decode")
    assert out["switches"][0]["at_s"] < start < first_back["at_s"]
    assert all(d["action"] in ("switch", "hold") for d in out["decisions"])


def test_a_run_is_the_same_for_the_same_inputs_and_differs_for_other_arrivals() -> None:
    phases = [Phase("a", 3.0, 300, 20, 20.0), Phase("b", 6.0, 40, 60, 20.0)]

    def figures(seed: int) -> list[tuple]:
        out = one_run("planner", simulate.fleet_requests(phases, seed), 3)
        return [(r.ttft, r.end) for r in out["records"]] + [tuple(s.values()) for s in out["switches"]]

    assert figures(3) == figures(3)
    assert figures(3) != figures(4)


def test_the_fit_recovers_the_coefficients_of_exact_steps_and_drops_a_negative_one() -> None:
    true = {"fixed_s": 0.012, "per_token_s": 8e-4, "per_attention_s": 2e-7, "per_sample_s": 1e-3,
            "per_decode_attention_s": 3e-6}
    points = [(16, 200, 1, 0), (512, 1e5, 1, 0), (1024, 5e5, 1, 0), (1, 0, 1, 100), (8, 0, 8, 4000),
              (24, 0, 24, 3e4), (128, 3e4, 1, 0), (8, 0, 8, 300), (520, 1.3e5, 9, 4000)]
    rows = [fit.features(*p) for p in points]
    seconds = [sum(c * f for c, f in zip(true.values(), row)) for row in rows]
    assert fit.fit_linear(rows, seconds) == pytest.approx(true, rel=1e-6)
    falling = [0.02 - 1e-6 * p[0] for p in points]  # more tokens, less time: no cost can say that
    assert min(fit.fit_linear(rows, falling).values()) >= 0.0


def test_the_metrics_the_planner_reads_are_the_engines_counters() -> None:
    engine = SimEngine(SIMPLE)
    engine.add(Job("a", Work.LOCAL, 300, 5))
    engine.schedule()
    engine.finish()
    counters = server_counters(metrics_text(engine), 0.0)
    assert (counters.computed, counters.steps, counters.generated, counters.running) == (300, 1, 1, 1)
    assert counters.busy_s == pytest.approx(0.01 + 0.3)


def test_capacity_is_the_highest_rate_some_static_split_serves_within_the_slo() -> None:
    rate, prefill = trace.capacity(SIMPLE, 4, 990, 10, 3.0, 0.03)
    costs = trace.planner_costs(SIMPLE, 990, 10)
    assert costs.prefill_tokens_per_s == pytest.approx(990 / 1.0)  # 10 ms + 990 x 1 ms a prompt
    assert (costs.decode_step_s, costs.decode_step_per_seq_s) == pytest.approx((0.01, 0.001))

    def score(p: int, r: float) -> float:
        return predict(p, 4 - p, Load(r, 990, 10), costs, 0.9).score(3.0, 0.03)

    assert score(prefill, rate * 0.999) <= 1  # met just under it...
    assert all(score(p, rate * 1.01) > 1 for p in range(1, 4))  # ...by no split just over it
    assert rate < 3 * 1.0  # below the three prefill servers' saturation (a request a second each): queues count


def test_a_trace_loads_by_default_the_one_static_split_keeping_most_of_each_phases_best() -> None:
    """Long prompts want prefill servers, long answers decode servers: the static reference
    is the split whose worst phase keeps the highest share of that phase's best split, and
    its capacity per phase is at most the phase's best (what a changing fleet can gain)."""
    phases = trace.parse_trace_phases("rag:seconds=10,load=1,input=2000,output=4;"
                                      "gen:seconds=10,load=1,input=20,output=400")
    rates = [trace.split_capacities(SIMPLE, 6, p.input, p.output, 5.0, 0.05) for p in phases]
    static, split = trace.phase_capacities(phases, SIMPLE, 6, 5.0, 0.05, "static")
    shares = [min(r[p - 1] / max(r) for r in rates) for p in range(1, 6)]
    assert shares[split - 1] == max(shares) < 1  # no one split is best for both
    assert static == [r[split - 1] for r in rates]
    best, none = trace.phase_capacities(phases, SIMPLE, 6, 5.0, 0.05, "phase")
    assert none is None and best == [max(r) for r in rates] and all(s < b for s, b in zip(static, best))
    with pytest.raises(ValueError, match="capacity reference"):
        trace.phase_capacities(phases, SIMPLE, 6, 5.0, 0.05, "oracle")


def test_the_cli_simulates_a_generated_trace_and_validates_a_result_against_itself(tmp_path) -> None:
    costs = tmp_path / "costs.json"
    SIMPLE.save(costs)
    path = tmp_path / "t.jsonl"
    made = simulate.main(["trace", "--costs", str(costs), "--servers", "3", "--phases",
                          "a:seconds=20,load=0.6,input=300,output=20;b:seconds=20,load=1.2,input=40,output=80",
                          "--ttft-slo", "3", "--tpot-slo", "0.05", "--output", str(path)])
    records = read_trace(path)
    assert len(records) == made["records"] > 0 and all(len(r.hash_ids) == -(-r.input_length // 512) for r in records)
    out = tmp_path / "run"
    results = simulate.main(["run", "--costs", str(costs), "--servers", "3", "--trace", str(path), "--trace-phases",
                             made["trace_phases"], "--tpot-slo", "0.05", "--output-dir", str(out)])
    assert set(results) == {"planner", "colocated", "conditional", "1p2d", "2p1d"}
    assert set(results["planner"]) == {"a", "b", "all"}
    saved = json.loads((out / "simulate.json").read_text())
    first = min(r.timestamp for r in records)  # the replay's clock starts at the first request
    assert saved["medians"]["colocated"]["a"]["requests"] == sum(r.timestamp - first < 20000 for r in records)
    phased = tmp_path / "phased"
    simulate.main(["run", "--costs", str(costs), "--servers", "2", "--configs", "colocated,1p1d,conditional",
                   "--phases", "x:rate=2,input=200,output=10,seconds=10", "--output-dir", str(phased)])
    rows = simulate.main(["validate", "--costs", str(costs), "--fleet", str(phased / "simulate.json"),
                          "--output-dir", str(tmp_path)])
    assert {r["config"] for r in rows} == {"colocated", "1p1d", "conditional"}
    assert all(r["ttft_p50_s"][2] == 0 and r["tpot_p50_s"][2] == 0 for r in rows)  # the same run, to the digit
