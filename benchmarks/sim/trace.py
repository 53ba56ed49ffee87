"""Workloads for the simulator: `pd bench fleet`'s phases (the same arrivals, seed for
seed), or a trace in Mooncake's format (`benchmarks/datasets.py`), and a seeded generator
of bursty Mooncake-format traces whose phases load a fleet to a chosen share of its
capacity.

The generator's phases are `NAME:seconds=S,load=L,input=I,output=O`: for S seconds,
requests with prompts of about I tokens and answers of about O (lognormal, sigma
`SIGMA`), arriving as a Poisson process whose rate alternates every `burst_s` seconds
between (1 + burst) and (1 - burst) times L x the fleet's capacity for that mix. A
split's capacity for a mix is the highest arrival rate at which it meets both SLOs (TTFT
at the percentile, queueing included, and TPOT) as the planner's model predicts them
(planner/model.py) from the costs: the costs' own figure, not a measured one. (A split's
saturation, prompts computed back to back, is no capacity to load: at 1.0 of it a queue
grows without end, and every configuration was swamped alike.) The fleet's capacity
(`phase_capacities`) is by default a static deployment's: that of the one split that keeps
the most of each phase's best split (its worst phase's share highest), the split a fleet
sized for the whole trace would run; so at load 1 that split just keeps the SLO in every
phase, and what a fleet gains by changing its split shows above 1. With `reference`
"phase" it is each phase's best split's, so that above 1 no split keeps the SLO. Every
prompt block gets its own hash id (no prefix is shared: the simulator does not model the
prefix cache).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.datasets import MOONCAKE_BLOCK_TOKENS, read_trace
from benchmarks.fleet import Phase, split_phases
from benchmarks.sim.costs import StepCosts
from benchmarks.sim.fleet import SimRequest
from planner.model import Costs, Load, predict

SIGMA = 0.5  # of the lengths' lognormal
MAX_TOKENS = 8192  # a prompt and its answer at most
CAPACITY_REFERENCES = ("static", "phase")


@dataclass(frozen=True)
class TracePhase:
    name: str
    seconds: float
    load: float  # of the capacity
    input: int
    output: int


def parse_trace_phases(text: str) -> list[TracePhase]:
    phases = []
    for part, name, f in split_phases(text, "NAME:seconds=S,load=L,input=I,output=O",
                                      ("seconds", "load", "input", "output")):
        phase = TracePhase(name, f["seconds"], f["load"], int(f["input"]), int(f["output"]))
        if not name or min(phase.seconds, phase.load, phase.input, phase.output) <= 0:
            raise ValueError(f"--phases: {part!r} needs a name and positive figures")
        phases.append(phase)
    return phases


def planner_costs(costs: StepCosts, prompt: float, output: float) -> Costs:
    """The step costs as the planner's model takes them, for requests of this mix."""
    context = prompt + output / 2
    a1, a2 = costs.decode_step_s(1, context), costs.decode_step_s(2, context)
    return Costs(prefill_tokens_per_s=prompt / costs.prefill_s(round(prompt)), decode_step_s=2 * a1 - a2,
                 decode_step_per_seq_s=a2 - a1, transfer_s=costs.transfer_s(round(prompt)))


def split_capacities(costs: StepCosts, n: int, prompt: float, output: float, ttft_slo_s: float,
                     tpot_slo_s: float, percentile: float = 0.9) -> list[float]:
    """Requests per second each static split of `n` servers (index p - 1: p prefill
    servers) serves within the SLO, for this mix (by the planner's model; a bisection each)."""
    model_costs = planner_costs(costs, prompt, output)

    def meets(p: int, rate: float) -> bool:
        return predict(p, n - p, Load(rate, prompt, output), model_costs, percentile).score(ttft_slo_s,
                                                                                            tpot_slo_s) <= 1
    rates = []
    for p in range(1, n):
        low, high = 0.0, 1.0
        while meets(p, high):
            low, high = high, high * 2
        for _ in range(40):
            mid = (low + high) / 2
            low, high = (mid, high) if meets(p, mid) else (low, mid)
        rates.append(low)
    return rates


def capacity(costs: StepCosts, n: int, prompt: float, output: float, ttft_slo_s: float, tpot_slo_s: float,
             percentile: float = 0.9) -> tuple[float, int]:
    """Requests per second the best static split of `n` servers serves within the SLO, for
    this mix, and its prefill servers."""
    rates = split_capacities(costs, n, prompt, output, ttft_slo_s, tpot_slo_s, percentile)
    best = max(range(len(rates)), key=lambda i: (rates[i], i))
    return rates[best], best + 1


def phase_capacities(phases: list[TracePhase], costs: StepCosts, n: int, ttft_slo_s: float, tpot_slo_s: float,
                     reference: str) -> tuple[list[float], int | None]:
    """Each phase's capacity, requests per second, and the static split's prefill servers
    it is of (None: each phase's own best split). `reference` "static": the one split of
    the fleet that keeps the most of each phase's best, its worst phase's share of that
    highest (the split a deployment sized for the whole trace would run), loaded in every
    phase to what it serves within the SLO; "phase": each phase's best split."""
    if reference not in CAPACITY_REFERENCES:
        raise ValueError(f"capacity reference {reference!r}: one of {', '.join(CAPACITY_REFERENCES)}")
    rates = [split_capacities(costs, n, phase.input, phase.output, ttft_slo_s, tpot_slo_s) for phase in phases]
    if reference == "phase":
        return [max(r) for r in rates], None
    split = max(range(n - 1), key=lambda i: (min(r[i] / max(r) for r in rates), i))
    return [r[split] for r in rates], split + 1


def generate(phases: list[TracePhase], capacities: list[float], burst: float, burst_s: float,
             seed: int) -> list[dict]:
    """The trace's records (Mooncake's fields), in time order: each phase loaded to its
    share of its capacity (`phase_capacities`), requests per second."""
    rng = np.random.default_rng(seed)
    records, start, next_hash = [], 0.0, 0
    for phase, capacity_rate in zip(phases, capacities):
        rate = capacity_rate * phase.load
        t = start
        while True:
            high = int((t - start) // burst_s) % 2 == 0
            t += rng.exponential(1.0 / (rate * (1 + burst if high else 1 - burst)))
            if t >= start + phase.seconds:
                break
            prompt = _length(rng, phase.input, MAX_TOKENS // 2)
            output = _length(rng, phase.output, MAX_TOKENS - prompt)
            blocks = -(-prompt // MOONCAKE_BLOCK_TOKENS)
            records.append({"timestamp": round(t * 1000), "input_length": prompt, "output_length": output,
                            "hash_ids": list(range(next_hash, next_hash + blocks))})
            next_hash += blocks
        start += phase.seconds
    return records


def _length(rng: np.random.Generator, mean: float, most: int) -> int:
    return int(min(most, max(1, round(rng.lognormal(np.log(mean) - SIGMA ** 2 / 2, SIGMA)))))


def write_trace(records: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def trace_requests(path: Path, phase_spec: str | None, speed: float) -> tuple[list[SimRequest], list[Phase]]:
    """The trace's requests, arriving `speed` times as fast, and its phases:
    `NAME:seconds=S;...` split the (sped-up) timeline; none: one phase, all of it."""
    records = sorted(read_trace(path), key=lambda r: r.timestamp)
    first = records[0].timestamp
    times = [(r.timestamp - first) / 1000.0 / speed for r in records]
    bounds = _phase_bounds(phase_spec, times[-1] + 1e-9)
    requests, start = [], 0.0
    for r, t in zip(records, times):
        name = next(name for name, end in bounds if t < end)
        requests.append(SimRequest(t, r.input_length, max(1, r.output_length), name))
    phases, start = [], 0.0
    for name, end in bounds:
        mine = [q for q in requests if q.phase == name]
        seconds = end - start
        phases.append(Phase(name, len(mine) / seconds, round(np.mean([q.prompt for q in mine])) if mine else 1,
                            round(np.mean([q.output for q in mine])) if mine else 1, seconds))
        start = end
    return requests, phases


def _phase_bounds(spec: str | None, end: float) -> list[tuple[str, float]]:
    if not spec:
        return [("trace", end)]
    bounds, at = [], 0.0
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, seconds = part.partition(":seconds=")
        try:
            at += float(seconds)
        except ValueError:
            raise ValueError(f"--trace-phases: {part!r} is not NAME:seconds=S") from None
        bounds.append((name.strip(), at))
    bounds[-1] = (bounds[-1][0], max(bounds[-1][1], end))
    return bounds
