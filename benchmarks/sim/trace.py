"""Workloads for the simulator: `pd bench fleet`'s phases (the same arrivals, seed for
seed), or a trace in Mooncake's format (`benchmarks/datasets.py`), and a seeded generator
of bursty Mooncake-format traces whose phases load a fleet to a chosen share of its
capacity.

The generator's phases are `NAME:seconds=S,load=L,input=I,output=O`: for S seconds,
requests with prompts of about I tokens and answers of about O (lognormal, sigma
`SIGMA`), arriving as a Poisson process whose rate alternates every `burst_s` seconds
between (1 + burst) and (1 - burst) times L x the fleet's capacity for that mix. The
capacity (`capacity`) is the best static split's: P servers computing prompts back to
back against D servers each decoding the largest batch whose step keeps the TPOT SLO;
it is the costs' own figure, not a measured one. Every prompt block gets its own
hash id (no prefix is shared: the simulator does not model the prefix cache).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.datasets import MOONCAKE_BLOCK_TOKENS, read_trace
from benchmarks.fleet import Phase
from benchmarks.sim.costs import StepCosts
from benchmarks.sim.fleet import SimRequest

SIGMA = 0.5  # of the lengths' lognormal
MAX_TOKENS = 8192  # a prompt and its answer at most


@dataclass(frozen=True)
class TracePhase:
    name: str
    seconds: float
    load: float  # of the capacity
    input: int
    output: int


def parse_trace_phases(text: str) -> list[TracePhase]:
    phases = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, spec = part.partition(":")
        try:
            f = {k.strip(): float(v) for k, v in (item.split("=") for item in spec.split(","))}
            phase = TracePhase(name.strip(), f["seconds"], f["load"], int(f["input"]), int(f["output"]))
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{part!r} is not NAME:seconds=S,load=L,input=I,output=O ({exc})") from None
        if not name.strip() or min(phase.seconds, phase.load, phase.input, phase.output) <= 0:
            raise ValueError(f"{part!r} needs a name and positive figures")
        phases.append(phase)
    if not phases:
        raise ValueError("no phase given")
    return phases


def capacity(costs: StepCosts, n: int, prompt: float, output: float, tpot_slo_s: float) -> tuple[float, int]:
    """Requests per second the best static split of `n` servers sustains for this mix,
    and its prefill servers."""
    per_prefill = 1.0 / costs.prefill_s(round(prompt))
    context = prompt + output / 2
    batch = 1
    while batch < costs.max_num_seqs and costs.decode_step_s(batch + 1, context) <= tpot_slo_s:
        batch += 1
    per_decode = batch / (output * costs.decode_step_s(batch, context))
    return max((min(p * per_prefill, (n - p) * per_decode), p) for p in range(1, n))


def generate(phases: list[TracePhase], costs: StepCosts, n: int, tpot_slo_s: float, burst: float, burst_s: float,
             seed: int) -> list[dict]:
    """The trace's records (Mooncake's fields), in time order."""
    rng = np.random.default_rng(seed)
    records, start, next_hash = [], 0.0, 0
    for phase in phases:
        rate, _ = capacity(costs, n, phase.input, phase.output, tpot_slo_s)
        rate *= phase.load
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
