"""`pd bench simulate fit`: the engine's step costs measured in process and fitted
(`costs.py`'s linear model), with the KV bytes per token from the engine's KV cache.

Measured on one in-process `EngineCore` (as `pd bench step` does), with the threads the
live servers get (`--num-threads 1` in pd bench fleet):
- prefill steps: a chunk of n new tokens after c cached ones (a prompt whose first c
  tokens an earlier request left in the prefix cache), for every n of `--prefill-tokens`
  and c of `--contexts`; the prompt's last chunk, so it samples one token;
- decode steps: `--batches` sequences decoding together at each context;
- mixed steps, held out of the fit and reported against it: a prefill chunk scheduled
  beside a decode batch, as a colocated server runs them.

A decode token's attention is fitted apart from a prompt chunk's (`costs.py`). Each
point is the median of `--repeats` steps (decode points: 4x as many). The fit is least
squares on relative error (every point counts alike, short steps as long ones); a
coefficient the data make negative is dropped (0) and the rest refitted. The transfer's rate and fixed time are
not measured here (flags: by default the NIXL READ rate `python -m benchmarks.transfer`
measured on this host, see the README). With `--live`, the fixed costs a deployment adds
(HTTP legs, the server's engine loop, the KV read's fixed part) are measured on idle
live deployments (`probe.py`); without, they are 0 unless given.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from dataclasses import replace

import numpy as np

from benchmarks.sim import probe
from benchmarks.sim.costs import StepCosts, attention_of
from pd.config.flags import max_step_ms_arg
from pd.config.settings import SchedulerSettings

FEATURES = ("fixed_s", "per_token_s", "per_attention_s", "per_sample_s", "per_decode_attention_s")
# the decode steps --corun times, alone and beside another: a light load's, the most bound by memory (measured:
# 1.15-1.19x at batch 3 over 128 tokens, 1.02x at batch 8 over 512, where compute takes a larger share)
CORUN_BATCH, CORUN_CONTEXT, CORUN_STEPS, CORUN_ROUNDS = 3, 128, 40, 5


def features(tokens: int, attention: float, samples: int, decode_attention: float = 0.0) -> list[float]:
    return [1.0, float(tokens), float(attention), float(samples), float(decode_attention)]


def fit_linear(rows: list[list[float]], seconds: list[float]) -> dict[str, float]:
    """Non-negative coefficients of FEATURES minimizing the relative error."""
    x, y = np.array(rows), np.array(seconds)
    keep = list(range(len(FEATURES)))
    while True:
        weights = 1.0 / y
        coef, *_ = np.linalg.lstsq(x[:, keep] * weights[:, None], y * weights, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    out = dict.fromkeys(FEATURES, 0.0)
    out.update({FEATURES[k]: float(max(c, 0.0)) for k, c in zip(keep, coef)})
    return out


class Probe:
    """One engine, stepped by hand: prompts of random ids sharing cached prefixes."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from pd.config import EngineConfig
        from pd.engine.core import EngineCore

        self.torch = torch
        longest = max(max(args.contexts) + max(args.prefill_tokens) + args.repeats * 64, CORUN_CONTEXT + 256) + 64
        config = EngineConfig.from_flat(model=str(args.model), max_num_seqs=max(*args.batches, CORUN_BATCH) + 1,
                                        max_model_len=longest + 64, max_num_batched_tokens=args.max_num_batched_tokens,
                                        max_step_ms="off",  # each step exactly as composed here
                                        num_threads=args.num_threads).resolve()
        self.engine = EngineCore(config)
        self.vocab = self.engine.model_config.vocab_size
        self.gen = torch.Generator().manual_seed(0)
        self.prefixes: dict[int, list[int]] = {}
        self.count = 0

    def ids(self, n: int) -> list[int]:
        return self.torch.randint(10, self.vocab - 10, (n,), generator=self.gen).tolist()

    def prefix(self, context: int) -> list[int]:
        """`context` ids whose KV the prefix cache holds (computed once, by a request of their own)."""
        if context not in self.prefixes:
            self.prefixes[context] = self.ids(context)
            if context:
                self.run_to_end(self.add(self.prefixes[context] + self.ids(1), 1))
        return self.prefixes[context]

    def add(self, prompt: list[int], max_tokens: int) -> str:
        from pd.contracts.request import Request
        from pd.contracts.sampling_params import SamplingParams

        self.count += 1
        request_id = f"fit-{self.count}"
        self.engine.add_request(Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                           ignore_eos=True)))
        return request_id

    def run_to_end(self, *_: str) -> None:
        while self.engine.scheduler.has_unfinished_requests:
            self.engine.step()

    def timed_step(self) -> float:
        start = time.perf_counter()
        self.engine.step()
        return time.perf_counter() - start

    def prefill(self, new: int, context: int) -> float:
        """One step computing `new` tokens after `context` cached ones (and sampling one)."""
        prompt = self.prefix(context) + self.ids(new)
        self.add(prompt, 1)
        seconds = self.timed_step()
        self.run_to_end()
        return seconds

    def decode(self, batch: int, context: int, steps: int) -> list[float]:
        """`steps` decode steps of `batch` sequences at about `context` tokens each."""
        base = self.prefix(context)
        for _ in range(batch):
            self.add(base + self.ids(1), steps + 4)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in self.engine.scheduler.running) or \
                len(self.engine.scheduler.running) < batch:
            self.engine.step()
        self.engine.step()
        seconds = [self.timed_step() for _ in range(steps)]
        self.run_to_end()
        return seconds

    def mixed(self, batch: int, context: int, new: int) -> float:
        """A step holding `batch` decode tokens at `context` and a `new`-token prompt chunk."""
        base = self.prefix(context)
        for _ in range(batch):
            self.add(base + self.ids(1), 8)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in self.engine.scheduler.running) or \
                len(self.engine.scheduler.running) < batch:
            self.engine.step()
        self.engine.step()
        self.add(self.ids(new), 1)
        seconds = self.timed_step()
        self.run_to_end()
        return seconds

    def kv_bytes_per_token(self) -> float:
        kv = self.engine.kv_cache_config
        return sum(len(g.layer_names) * g.spec.page_size_bytes / g.spec.block_size for g in kv.groups)

    def shutdown(self) -> None:
        self.engine.shutdown()


def measure(args: argparse.Namespace) -> dict:
    """Every point measured: (kind, tokens, attention, samples, seconds, what it was)."""
    probe = Probe(args)
    points: list[dict] = []
    try:
        probe.prefill(64, 0)  # warm-up
        for context in args.contexts:
            for new in args.prefill_tokens:
                seconds = statistics.median(probe.prefill(new, context) for _ in range(args.repeats))
                points.append({"kind": "prefill", "new": new, "context": context, "tokens": new,
                               "attention": attention_of(new, context), "samples": 1, "seconds": seconds})
            for batch in args.batches:
                seconds = statistics.median(probe.decode(batch, context, 4 * args.repeats))
                points.append({"kind": "decode", "batch": batch, "context": context + 2, "tokens": batch,
                               "attention": 0.0, "decode_attention": batch * attention_of(1, context + 2),
                               "samples": batch, "seconds": seconds})
        for batch, context, new in args.mixed:
            seconds = statistics.median(probe.mixed(batch, context, new) for _ in range(args.repeats))
            points.append({"kind": "mixed", "batch": batch, "context": context, "new": new, "tokens": batch + new,
                           "attention": attention_of(new, 0), "decode_attention": batch * attention_of(1, context + 2),
                           "samples": batch + 1, "seconds": seconds})
        corun = corun_factor(probe, args) if args.corun else None
        return {"points": points, "kv_bytes_per_token": probe.kv_bytes_per_token(), "corun": corun}
    finally:
        probe.shutdown()


def _neighbour(args: argparse.Namespace, ready, running, stop, steps) -> None:
    """A second engine in a process of its own, decoding while `running` is set, until
    `stop`; it counts its steps in `steps`."""
    probe = Probe(args)
    try:
        base = probe.prefix(CORUN_CONTEXT)
        ready.set()
        while not stop.is_set():
            if not running.wait(0.05):
                continue
            if not probe.engine.scheduler.has_unfinished_requests:
                for _ in range(CORUN_BATCH):
                    probe.add(base + probe.ids(1), 200)
            probe.engine.step()
            steps.value += 1
    finally:
        probe.shutdown()


def corun_factor(probe: Probe, args: argparse.Namespace) -> dict:
    """How much slower a decode step is while a second engine (a process of its own, the
    same model and threads) steps beside it on this host, as the servers of a fleet on one
    machine do: the shared memory bandwidth and caches. CORUN_ROUNDS rounds, each the
    median of CORUN_STEPS steps alone, then as many beside the other; the median ratio.
    Each round keeps the other's steps in each half (none alone), so that a round it sat
    out shows in the points file."""
    spawn = multiprocessing.get_context("spawn")
    ready, running, stop, steps = spawn.Event(), spawn.Event(), spawn.Event(), spawn.Value("l", 0, lock=False)
    neighbour = spawn.Process(target=_neighbour, args=(args, ready, running, stop, steps), daemon=True)
    neighbour.start()
    rounds = []
    try:
        if not ready.wait(600):
            raise RuntimeError("--corun: the second engine did not start within 600 s")
        for _ in range(CORUN_ROUNDS):
            running.clear()
            time.sleep(0.1)  # its step under way ends
            before = steps.value
            alone = statistics.median(probe.decode(CORUN_BATCH, CORUN_CONTEXT, CORUN_STEPS))
            idle = steps.value - before
            running.set()
            time.sleep(0.1)
            before = steps.value
            beside = statistics.median(probe.decode(CORUN_BATCH, CORUN_CONTEXT, CORUN_STEPS))
            rounds.append((alone, beside, idle, steps.value - before))
    finally:
        stop.set()
        running.set()
        neighbour.join(120)
        if neighbour.is_alive():
            neighbour.kill()
            neighbour.join()
    factor = statistics.median(beside / alone for alone, beside, _, _ in rounds)
    return {"rounds": rounds, "factor": max(1.0, factor)}


def fit(args: argparse.Namespace) -> tuple[StepCosts, list[dict]]:
    """The costs and every point with what the fit predicts for it."""
    measured = measure(args)
    points = measured["points"]
    fitted = [p for p in points if p["kind"] != "mixed"]
    coef = fit_linear([features(p["tokens"], p["attention"], p["samples"], p.get("decode_attention", 0.0))
                       for p in fitted],
                      [p["seconds"] for p in fitted])
    costs = StepCosts(**coef, kv_bytes_per_token=measured["kv_bytes_per_token"],
                      transfer_bytes_per_s=args.transfer_gbps * 1e9, transfer_fixed_s=args.transfer_fixed_ms / 1e3,
                      transfer_polls=args.transfer_polls, hop_s=args.hop_ms / 1e3,
                      corun_factor=measured["corun"]["factor"] if measured["corun"] else 1.0,
                      max_num_batched_tokens=args.max_num_batched_tokens, max_step_ms=args.max_step_ms,
                      max_num_seqs=args.max_num_seqs, model=str(args.model), threads=args.num_threads)
    for p in points:
        p["predicted"] = costs.step_s(p["tokens"], p["attention"], p["samples"], p.get("decode_attention", 0.0))
    if measured["corun"]:
        points.append({"kind": "corun", **measured["corun"]})
    if args.live:
        live = probe.measure(args.model, args.live_requests, f"--num-threads {args.num_threads}")
        costs = replace(costs, **probe.fixed_costs(costs, live))
        points.append({"kind": "live", **{f"{c}_{k}": v for c, figures in live.items() for k, v in figures.items()}})
    return costs, points


def format_points(points: list[dict]) -> str:
    points = [p for p in points if p["kind"] not in ("live", "corun")]
    lines = ["| kind | batch | new tokens | context | measured ms | fitted ms | error |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        lines.append(f"| {p['kind']}{' (held out)' if p['kind'] == 'mixed' else ''} | {p.get('batch', '-')} | "
                     f"{p.get('new', '-')} | {p['context']} | {p['seconds'] * 1e3:.2f} | {p['predicted'] * 1e3:.2f} | "
                     f"{(p['predicted'] - p['seconds']) / p['seconds']:+.0%} |")
    return "\n".join(lines)


def add_fit_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", required=True, help="model directory or .gguf file (as the servers serve it)")
    add("--output", required=True, help="the costs file to write (JSON)")
    add("--num-threads", type=int, default=1, help="torch threads, as each live server's (default 1)")
    add("--prefill-tokens", type=int, nargs="+", default=[16, 128, 512, 1024],
        help="prompt chunk sizes measured (default 16 128 512 1024)")
    add("--contexts", type=int, nargs="+", default=[0, 512, 1536],
        help="cached tokens before a chunk, and decode contexts (default 0 512 1536)")
    add("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 24],
        help="decode batches measured (default 1 2 4 8 24: a step costs about the same up to 4, bound by reading the "
             "weights, then grows with the batch, which a line fits only where it has points at both ends)")
    add("--mixed", type=lambda s: tuple(int(v) for v in s.split("x")), nargs="*",
        default=[(8, 256, 512), (4, 64, 1000)],
        help="held-out mixed steps BATCHxCONTEXTxNEW, checked against the fit (default 8x256x512 4x64x1000)")
    add("--repeats", type=int, default=5, help="steps per point, median (default 5)")
    add("--max-num-batched-tokens", type=int, default=SchedulerSettings.max_num_batched_tokens,
        help="the servers' token budget per step, as their --max-num-batched-tokens (default %(default)s)")
    add("--max-step-ms", type=max_step_ms_arg, default=SchedulerSettings.max_step_ms, metavar="MS",
        help="the servers' --max-step-ms, which the simulated engines' steps keep to as theirs do (the prompt tokens "
             "a step takes beside decodes; default %(default)s)")
    add("--max-num-seqs", type=int, default=SchedulerSettings.max_num_seqs,
        help="the servers' batch bound, as their --max-num-seqs (default %(default)s)")
    add("--transfer-gbps", type=float, default=6.5,
        help="KV read rate, GB/s (default 6.5: NIXL READ on this host, python -m benchmarks.transfer)")
    add("--transfer-fixed-ms", type=float, default=0.0, help="a KV read's fixed time, ms (default 0)")
    add("--transfer-polls", type=int, default=2,
        help="step ends a busy decode server takes to hear of a read whose bytes are in (default 2: on CPU the "
             "NIXL agent progresses only when a step polls it, and a read is the data's READ, then the lease "
             "word's; 1 without a lease)")
    add("--corun", action="store_true",
        help="also measure how much slower a decode step is while a second engine steps beside it on this host "
             "(corun_factor, for pd bench simulate validate's fleet on one machine; 1 without)")
    add("--hop-ms", type=float, default=0.0, help="one HTTP leg's time, ms, unless --live measures it (default 0)")
    add("--live", action="store_true",
        help="also measure the fixed costs of live deployments (HTTP legs, the server's engine loop, the KV read's "
             "fixed part): one colocated and one 1P1D pair of servers, idle, one request at a time")
    add("--live-requests", type=int, default=24, help="requests timed on each live deployment (default 24)")
