"""One engine step, broken down: where a decode step's time goes, and its page faults.

Loads a model into an in-process EngineCore, admits `--batch` requests whose prompts
bring each to `--context` tokens, prefills them, then times `--steps` decode steps.
Per step: the whole step as the engine serves it (its layers in one native call, or its
native layer plans, where the model has them: `pd.models.native_decoder`,
`pd.models.native_layers`), then, over as many steps run on the module
path, the model's attention, MLP, lm_head and sampling (forward hooks with wall clocks: on
CPU every op is synchronous; hooks fire only on modules) and the rest (scheduler, input
preparation, norms, embeddings); plus minor page faults per step, the sign of an
allocator that hands memory back to the OS and faults it in again.

The linears (the lm_head's included) and the lm_head are read against their bound as
served: the lm_head in the served steps (the model's `compute_logits` timed by a wrapper),
the linears over as many steps on the layer plans (one native call for all layers runs
their kernels from C, where no wrapper sees them), each linear's own `forward` timed by a
wrapper, so no module-call or hook overhead is counted in them.

Each is read against the machine's bound (`step_work`, `bound`): the bytes a step must read
(every linear's weights as they are kept: GGUF blocks by type, int8, bfloat16 or float32;
the KV its requests attend to; Mamba states) over the memory's read bandwidth, and its
multiply-adds over the peak of the instruction that makes them, the larger of the two
(`python -m benchmarks.peaks` measures both; here, unless given, on the engine's threads
before the model loads and again after the steps, each figure the faster of the two: on
these shared machines the memory's read rate moves between ~35 and ~62 GB/s within
minutes, and a bound taken in a slow minute rated steps run in a fast one past 1). The
fraction of the bound a part reaches is its bound over its time: 1 is the machine's limit.

    pd bench step --model MODEL.gguf --batch 8 --context 640 --dtype bfloat16
    python -m benchmarks.step --model DIR --output results/step.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from benchmarks import peaks
from pd.config import EngineConfig
from pd.config.settings import KV_CACHE_DTYPES, QUANTIZATIONS
from pd.contracts.request import Request
from pd.contracts.sampling_params import SamplingParams
from pd.engine.core import EngineCore
from pd.kv_cache.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec

# how a linear's weight is kept -> the instruction its multiply-adds are bound by (benchmarks.peaks)
PEAK_OF = {"gguf": "int8 dot (vpdpbusd)", "int8": "int8 dot (vpdpbusd)", "bfloat16": "bfloat16 dot (vdpbf16ps)",
           "float32": "float32 FMA (vfmadd)"}
PASSES = 3  # of warm-up and timed steps, each request decoding through all: as served, its linears timed, module path


class PartTimer:
    """Wall time spent inside modules of a kind, summed per step."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._started: dict[int, float] = {}
        self._wrapped: list[tuple[object, str, object]] = []

    def watch(self, module: nn.Module, part: str) -> None:
        module.register_forward_pre_hook(lambda m, args: self._start(m))
        module.register_forward_hook(lambda m, args, out: self._stop(m, part))

    def wrap(self, owner: object, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.totals[part] += time.perf_counter() - start

        setattr(owner, name, timed)
        self._wrapped.append((owner, name, inner))

    def restore(self) -> None:
        """Put back what `wrap` replaced."""
        for owner, name, inner in reversed(self._wrapped):
            setattr(owner, name, inner)
        self._wrapped.clear()

    def _start(self, module: nn.Module) -> None:
        self._started[id(module)] = time.perf_counter()

    def _stop(self, module: nn.Module, part: str) -> None:
        self.totals[part] += time.perf_counter() - self._started.pop(id(module))

    def take(self) -> dict[str, float]:
        totals, self.totals = dict(self.totals), defaultdict(float)
        return totals


def instrument(engine: EngineCore) -> PartTimer:
    from pd.attention.layer import Attention

    timer = PartTimer()
    for module in engine.model.modules():
        if isinstance(module, Attention):
            timer.watch(module, "attention")
        elif type(module).__name__.endswith("MLP"):
            timer.watch(module, "mlp")
    timer.wrap(engine.model, "compute_logits", "lm_head")
    timer.wrap(engine.runner, "_sample", "sampling")
    for module in engine.model.modules():  # inside the parts above: reported, not added
        if isinstance(module, nn.Linear):
            timer.watch(module, "linears")
    timer.wrap(engine.scheduler, "schedule", "scheduler")
    timer.wrap(engine.scheduler, "update_from_output", "scheduler")
    if engine.config.parallel.size > 1:  # inside the parts above: reported, not added
        timer.wrap(torch.distributed, "all_reduce", "collectives")
        timer.wrap(torch.distributed, "all_gather", "collectives")
    return timer


def linear_kind(linear: nn.Linear) -> tuple[str, int]:
    """How a linear's weight is kept for the step (a GGUF block type, int8, or its float
    dtype) and the bytes the step reads of it."""
    segments = getattr(linear, "gguf_segments", None)
    if segments:
        kinds = sorted({s.kind for s in segments})
        return "+".join(kinds), sum(t.numel() * t.element_size() for s in segments
                                    for t in (s.packed if s.packed is not None else s.weight,))
    for name in ("weight_packed", "weight_q"):  # --quantization int8
        held = getattr(linear, name, None)
        if held is not None:
            return "int8", held.numel() * held.element_size() + linear.weight_scale.numel() * 4
    held = getattr(linear, "packed_weight", None)
    held = held if held is not None else linear.weight
    return str(held.dtype).removeprefix("torch."), held.numel() * held.element_size()


def step_work(engine: EngineCore, batch: int, context: int) -> dict:
    """What one decode step of `batch` requests at `context` tokens must read and
    compute: weight bytes by kind (linears, the lm_head included; the embedding's `batch`
    rows and the norms are left out: a few KB), the KV bytes its requests attend to
    (per layer: the tokens in view, the window's for a sliding layer, the state for
    Mamba), and multiply-adds by the instruction that makes them."""
    weights: dict[str, int] = defaultdict(int)
    macs: dict[str, int] = defaultdict(int)
    lm_head = {"bytes": 0, "macs": 0, "peak": ""}
    for name, module in engine.model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        kind, nbytes = linear_kind(module)
        peak = PEAK_OF["gguf" if kind not in PEAK_OF else kind]
        weights[kind] += nbytes
        macs[peak] += batch * module.in_features * module.out_features
        if name.endswith("lm_head"):
            lm_head = {"bytes": nbytes, "macs": batch * module.in_features * module.out_features, "peak": peak}
    kv = 0
    for group in engine.kv_cache_config.groups:
        spec, layers = group.spec, len(group.layer_names)
        per_token = spec.real_page_size_bytes / spec.block_size
        if isinstance(spec, MambaSpec):
            kv += batch * layers * spec.real_page_size_bytes
        elif isinstance(spec, SlidingWindowSpec):
            kv += int(batch * layers * per_token * min(context, spec.sliding_window))
        elif isinstance(spec, FullAttentionSpec):
            kv += int(batch * layers * per_token * context)
    return {"weights": dict(weights), "kv": kv, "macs": dict(macs), "lm_head": lm_head}


def bound(nbytes: int, macs: dict[str, int], machine: dict) -> float:
    """Seconds the machine needs at least: the larger of the bytes over the read
    bandwidth and the multiply-adds over their instructions' peaks (all threads)."""
    memory = nbytes / (machine["memory"]["read"]["all_threads"] * 1e9)
    arithmetic = sum(count / (machine[peak]["all_threads"] * 1e9) for peak, count in macs.items())
    return max(memory, arithmetic)


def faster(first: dict, second: dict) -> dict:
    """The machine as the faster of two measurements of it: each peak's and each
    bandwidth's larger figure, at every level of the nesting."""
    return {key: faster(value, second[key]) if isinstance(value, dict) else max(value, second[key])
            for key, value in first.items()}


def measure_machine(threads: int, seconds: float = 0.3) -> dict:
    """benchmarks.peaks' figures on `threads` threads (the read bandwidth and the three
    multiply-add peaks), measured now: a step is read against this machine as it is."""
    machine = peaks.run(threads, seconds)
    machine["memory"] = peaks.run_memory(threads, seconds)
    return machine


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run(args: argparse.Namespace) -> dict:
    threads = args.num_threads or torch.get_num_threads()
    machine = json.loads(args.peaks.read_text()) if args.peaks else measure_machine(threads)
    config = EngineConfig.from_flat(model=args.model, dtype=args.dtype, quantization=args.quantization,
                                    kv_cache_dtype=args.kv_cache_dtype,
                                    max_num_seqs=max(args.batch, 1),
                                    max_model_len=args.context + PASSES * (args.steps + args.warmup) + 8,
                                    max_num_batched_tokens=max(2048, args.context), num_threads=args.num_threads,
                                    tensor_parallel_size=args.tensor_parallel_size).resolve()
    engine = EngineCore(config)
    try:
        result = _time_steps(args, engine)
    finally:
        engine.shutdown()
    if not args.peaks:  # and again now: the faster of the two bounds the machine
        after = measure_machine(threads)
        result["read_gbps_measured"] = [m["memory"]["read"]["all_threads"] for m in (machine, after)]
        machine = faster(machine, after)
    result["machine"] = machine
    result["bounds"] = bounds(result, machine)
    return result


def bounds(result: dict, machine: dict) -> dict:
    """The step's, the linears' and the lm_head's bound (seconds) and the fraction of it
    their median time reaches."""
    work, m = result["work"], result["medians"]
    step_bound = bound(sum(work["weights"].values()) + work["kv"], work["macs"], machine)
    linears_bound = bound(sum(work["weights"].values()), work["macs"], machine)
    head = work["lm_head"]
    head_bound = bound(head["bytes"], {head["peak"]: head["macs"]} if head["peak"] else {}, machine)
    return {"step": {"bound": step_bound, "fraction": step_bound / m["step"]},
            "linears": {"bound": linears_bound, "fraction": linears_bound / m["linears"] if m["linears"] else 0.0},
            "lm_head": {"bound": head_bound, "fraction": head_bound / m["lm_head"] if m["lm_head"] else 0.0},
            "read_gbps": machine["memory"]["read"]["all_threads"]}


def _time_steps(args: argparse.Namespace, engine: EngineCore) -> dict:
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=PASSES * (args.steps + args.warmup) + 2, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(Request(f"step-{i}", torch.randint(10, vocab - 10, (args.context,), generator=gen).tolist(),
                                   params))
    while len(engine.scheduler.running) < args.batch or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    as_served = _time_served_linears(args, engine)
    for module in engine.model.modules():
        if hasattr(module, "use_native_layers"):
            module.use_native_layers(False)
    timer = instrument(engine)
    for _ in range(args.warmup):
        engine.step()
    timer.take()
    steps = []
    for _ in range(args.steps):
        faults, start = minor_faults(), time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        parts = timer.take()
        parts["other"] = elapsed - sum(v for k, v in parts.items() if k not in ("collectives", "linears"))
        steps.append({"step": elapsed, "faults": minor_faults() - faults, **parts})
    keys = ["step", "attention", "mlp", "lm_head", "sampling", "scheduler", "other", "collectives", "linears"]
    medians = {k: statistics.median(s.get(k, 0.0) for s in steps) for k in keys}
    medians["faults"] = statistics.median(s["faults"] for s in steps)
    medians["step_modules"] = medians["step"]
    medians["linears_modules"], medians["lm_head_modules"] = medians["linears"], medians["lm_head"]
    for key in ("step", "linears", "lm_head"):
        medians[key] = statistics.median(s[key] for s in as_served)
    return {"model": args.model, "dtype": engine.config.model.dtype, "quantization": engine.config.model.quantization,
            "kv_cache_dtype": args.kv_cache_dtype, "batch": args.batch,
            "context": args.context,
            "steps": args.steps, "threads": torch.get_num_threads(), "tensor_parallel_size": args.tensor_parallel_size,
            "medians": medians, "per_step": steps, "work": step_work(engine, args.batch, args.context)}


def _time_served_linears(args: argparse.Namespace, engine: EngineCore) -> list[dict[str, float]]:
    """Per served step, its wall time and the time in the model's `compute_logits` (a
    wrapper on the instance); then per step on the layer plans (the native decoder off where
    the model has one: it calls the linears' kernels from C, past any wrapper), the time in
    every linear's `forward`, the lm_head's included (wrappers the plans call too: ~1 us a
    linear). Each part comes from the steps it was timed in."""
    served = _timed_steps(args, engine, {"lm_head": [(engine.model, "compute_logits")]})
    decoders = [m for m in engine.model.modules() if hasattr(m, "use_native_decoder")]
    for module in decoders:
        module.use_native_decoder(False)
    try:
        linears = [(m, "forward") for m in engine.model.modules() if isinstance(m, nn.Linear)]
        planned = _timed_steps(args, engine, {"linears": linears})
    finally:
        for module in decoders:
            module.use_native_decoder(True)
    return [{**step, "linears": plan.get("linears", 0.0)} for step, plan in zip(served, planned, strict=True)]


def _timed_steps(args: argparse.Namespace, engine: EngineCore, parts: dict[str, list[tuple[object, str]]]
                 ) -> list[dict[str, float]]:
    """`args.warmup` steps, then per timed step its wall time and the time in each part's
    wrapped methods (part -> (owner, method name))."""
    timer = PartTimer()
    for part, methods in parts.items():
        for owner, name in methods:
            timer.wrap(owner, name, part)
    try:
        for _ in range(args.warmup):
            engine.step()
        timer.take()
        steps = []
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            steps.append({"step": time.perf_counter() - start, **timer.take()})
        return steps
    finally:
        timer.restore()


def print_table(result: dict) -> None:
    m = result["medians"]
    print(f"decode step, batch {result['batch']}, context {result['context']}, {result['dtype']}, "
          f"quantization {result['quantization']}, KV {result.get('kv_cache_dtype', 'auto')}, "
          f"{result['threads']} threads, tensor-parallel size {result.get('tensor_parallel_size', 1)} "
          f"(median of {result['steps']} steps)")
    print("| part | ms | share |")
    print("|---|---:|---:|")
    whole = m.get("step_modules", m["step"])
    for key in ("attention", "mlp", "lm_head", "sampling", "scheduler", "other"):
        value = m.get(f"{key}_modules", m[key])
        print(f"| {key} | {value * 1e3:.2f} | {value / whole:.0%} |")
    print(f"| step, module path | {whole * 1e3:.2f} | 100% |")
    print(f"| **step as served** | **{m['step'] * 1e3:.2f}** | {m['step'] / whole:.0%} |")
    if m.get("collectives"):
        print(f"rank 0 in collectives (all-reduce, all-gather; inside the parts above): "
              f"{m['collectives'] * 1e3:.2f} ms")
    print(f"minor page faults per step: {m['faults']:.0f}")
    work, b = result["work"], result["bounds"]
    weights = ", ".join(f"{kind} {nbytes / 1e6:.1f} MB" for kind, nbytes in sorted(work["weights"].items()))
    reads = f"{b['read_gbps']:.1f} GB/s here"
    if "read_gbps_measured" in result:
        before, after = result["read_gbps_measured"]
        reads = f"{before:.1f} GB/s here before the steps and {after:.1f} after (the bounds take the faster)"
    print(f"a step reads: weights {sum(work['weights'].values()) / 1e6:.1f} MB ({weights}), KV {work['kv'] / 1e6:.1f}"
          f" MB; {sum(work['macs'].values()) / 1e9:.2f} G multiply-adds in linears; memory reads {reads}")
    print("| against the machine's bound | ms | bound, ms | fraction of the bound |\n|---|---:|---:|---:|")
    for key, time_key in (("lm_head", "lm_head"), ("linears", "linears"), ("step", "step")):
        name = {"lm_head": "lm_head, as served", "linears": "every linear, as served", "step": "step as served"}[key]
        print(f"| {name} | {m[time_key] * 1e3:.2f} | {b[key]['bound'] * 1e3:.2f} | {b[key]['fraction']:.2f} |")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model directory or .gguf file")
    parser.add_argument("--dtype", default="auto", help="weights and KV dtype (auto, bfloat16, float32, ...)")
    parser.add_argument("--kv-cache-dtype", choices=tuple(KV_CACHE_DTYPES), default="auto",
                        help="as pd serve --kv-cache-dtype (default auto)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="auto",
                        help="as pd serve --quantization: auto (default), none, int8 or gguf")
    parser.add_argument("--batch", type=int, default=8, help="requests decoding together")
    parser.add_argument("--context", type=int, default=640, help="prompt tokens of each request")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed")
    parser.add_argument("--warmup", type=int, default=3, help="decode steps run before timing")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads per rank (default: all cores)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="shard the model over this many ranks (as pd serve --tensor-parallel-size); the parts "
                             "are rank 0's (default %(default)s)")
    parser.add_argument("--peaks", type=Path, default=None, metavar="JSON",
                        help="the machine's peaks as `python -m benchmarks.peaks --output` wrote them, with its "
                             "--threads the engine's (default: measured before the model loads and after the "
                             "steps, ~5 s each, each figure the faster of the two)")
    parser.add_argument("--output", type=Path, default=None, help="write the result as JSON here")
    return parser


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> dict:
    args = build_parser(prog).parse_args(argv)
    result = run(args)
    print_table(result)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
