"""The CPU's arithmetic peaks, to read a decode step against: how many multiply-adds a second
the instructions our kernels are built on can do here, on one thread and on all.

    python -m benchmarks.peaks [--threads N] [--output peaks.json]

A step's linear layers cannot beat (their multiply-adds) / (the peak of the instruction that
computes them): at batch 8 the GGUF kernels are bound by `vpdpbusd`, not by the bytes of the
weights (README, Performance). Needs AVX-512 VNNI and BF16 and a C compiler.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

from pd import native

SOURCE = Path(__file__).parent / "csrc" / "peaks.c"
KINDS = {  # name -> (kernel kind, multiply-adds an instruction)
    "int8 dot (vpdpbusd)": (0, 64),
    "bfloat16 dot (vdpbf16ps)": (1, 32),
    "float32 FMA (vfmadd)": (2, 16),
}
CHAINS = 12  # instructions a round (peaks.c)
REPEATS = 3  # runs of each figure, the best kept


def _library() -> ctypes.CDLL | None:
    return native.load(SOURCE, {"peak": [native.I64, native.I64, native.I64, ctypes.POINTER(ctypes.c_double)]})


def measure(kind: int, threads: int, seconds: float, repeats: int = REPEATS) -> float | None:
    """Instructions of `kind` a second (billions) on `threads` threads, the best of
    `repeats` runs of at least `seconds` each (a peak: other work on the machine only
    lowers a run), or None where this CPU cannot run it."""
    library = _library()
    if library is None:
        return None
    sink = ctypes.c_double()

    def rate(iterations: int) -> tuple[float, float] | None:  # (seconds, G instructions/s)
        start = time.perf_counter()
        if library.peak(kind, iterations, threads, ctypes.byref(sink)):
            return None
        elapsed = time.perf_counter() - start
        return elapsed, iterations * CHAINS * threads / elapsed / 1e9

    iterations = 1 << 14
    while (first := rate(iterations)) is not None and first[0] < seconds:
        iterations *= 2
    if first is None:
        return None
    return max([first[1]] + [rate(iterations)[1] for _ in range(repeats - 1)])


def run(threads: int, seconds: float) -> dict:
    result = {}
    for name, (kind, macs) in KINDS.items():
        counts = [measure(kind, t, seconds) for t in sorted({1, threads})]
        if None in counts:
            raise SystemExit(f"this CPU (or its compiler) cannot run {name}: AVX-512 VNNI and BF16 needed")
        result[name] = {"threads": threads, "one_thread": counts[0] * macs, "all_threads": counts[-1] * macs}
    return result


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peaks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for the all-threads "
                        "figure (default: every CPU)")
    parser.add_argument("--seconds", type=float, default=0.5, help="time each figure at least this long")
    parser.add_argument("--output", help="write the result as JSON here")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.seconds <= 0:
        parser.error("--threads and --seconds must be positive")
    result = run(args.threads, args.seconds)
    print(f"| instruction | GMAC/s, 1 thread | GMAC/s, {args.threads} threads |\n|---|---:|---:|")
    for name, figures in result.items():
        print(f"| {name} | {figures['one_thread']:.1f} | {figures['all_threads']:.1f} |")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
