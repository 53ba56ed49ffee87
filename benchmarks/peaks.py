"""The machine's peaks, to read a decode step against: how many multiply-adds a second the
instructions our kernels are built on can do here, and how many bytes a second its memory
gives a streaming read and a copy, on one thread and on all.

    python -m benchmarks.peaks [--threads N] [--output peaks.json]

A step's linear layers cannot beat the larger of (their multiply-adds) / (the peak of the
instruction that computes them) and (the bytes of their weights) / (the read bandwidth):
`pd bench step` reads its parts against both (README, Performance). The multiply-add peaks
need AVX-512 VNNI and BF16; all need a C compiler.
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
from pd.huge_pages import huge_page_buffer

SOURCE = Path(__file__).parent / "csrc" / "peaks.c"
KINDS = {  # name -> (kernel kind, multiply-adds an instruction)
    "int8 dot (vpdpbusd)": (0, 64),
    "bfloat16 dot (vdpbf16ps)": (1, 32),
    "float32 FMA (vfmadd)": (2, 16),
}
CHAINS = 12  # instructions a round (peaks.c)
REPEATS = 3  # runs of each figure, the best kept
MEMORY = {"read": 0, "copy": 1}  # bandwidth kind -> peaks.c's; copy counts the bytes read and written
BUFFER_BYTES = 1 << 30  # far past any cache: what a step's weights are to the memory


def _library() -> ctypes.CDLL | None:
    sink = ctypes.POINTER(ctypes.c_double)
    return native.load(SOURCE, {"peak": [native.I64, native.I64, native.I64, sink],
                                "bandwidth": [native.I64, native.PTR, native.PTR, native.I64, native.I64, native.I64,
                                              sink]})


def bandwidth(kind: str, threads: int, seconds: float, nbytes: int = BUFFER_BYTES,
              repeats: int = REPEATS) -> float | None:
    """GB/s of `kind` (read, or copy: bytes read + written) over `nbytes` on `threads`
    threads, the best of `repeats` runs of at least `seconds` each; None without a C
    compiler."""
    library = _library()
    if library is None:
        return None
    nbytes -= nbytes % (256 * threads)
    # in 2 MiB pages, as the weights a step reads are kept (pd.huge_pages; from 4 KiB pages
    # this machine read 19-28 GB/s against 34-36), and written once by numpy, one thread,
    # so that every page is there before the clock starts
    source = huge_page_buffer(nbytes).numpy()
    source.fill(1)
    target = source
    if kind == "copy":
        target = huge_page_buffer(nbytes).numpy()
        target.fill(0)
    sink = ctypes.c_double()
    moved = nbytes * (2 if kind == "copy" else 1)

    def rate(rounds: int) -> tuple[float, float]:  # (seconds, GB/s)
        start = time.perf_counter()
        library.bandwidth(MEMORY[kind], source.ctypes.data, target.ctypes.data, nbytes, rounds, threads,
                          ctypes.byref(sink))
        elapsed = time.perf_counter() - start
        return elapsed, rounds * moved / elapsed / 1e9

    rounds = 1
    while (first := rate(rounds))[0] < seconds:
        rounds *= 2
    return max([first[1]] + [rate(rounds)[1] for _ in range(repeats - 1)])


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


def run_memory(threads: int, seconds: float, nbytes: int = BUFFER_BYTES) -> dict:
    """GB/s of a streaming read and of a copy over `nbytes`, on one thread and on `threads`."""
    result = {}
    for kind in MEMORY:
        rates = [bandwidth(kind, t, seconds, nbytes) for t in sorted({1, threads})]
        if None in rates:
            raise SystemExit("no C compiler: the memory figures need one")
        result[kind] = {"threads": threads, "one_thread": rates[0], "all_threads": rates[-1]}
    return result


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
    parser.add_argument("--memory-mib", type=int, default=BUFFER_BYTES >> 20,
                        help="bytes the memory figures stream over, in MiB: well past the caches (default %(default)s)")
    parser.add_argument("--output", help="write the result as JSON here")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.seconds <= 0 or args.memory_mib < 1:
        parser.error("--threads, --seconds and --memory-mib must be positive")
    result = run(args.threads, args.seconds)
    print(f"| instruction | GMAC/s, 1 thread | GMAC/s, {args.threads} threads |\n|---|---:|---:|")
    for name, figures in result.items():
        print(f"| {name} | {figures['one_thread']:.1f} | {figures['all_threads']:.1f} |")
    result["memory"] = run_memory(args.threads, args.seconds, args.memory_mib << 20)
    print(f"\n| memory ({args.memory_mib} MiB) | GB/s, 1 thread | GB/s, {args.threads} threads |\n|---|---:|---:|")
    for kind, figures in result["memory"].items():
        what = "streaming read" if kind == "read" else "copy (read + written)"
        print(f"| {what} | {figures['one_thread']:.1f} | {figures['all_threads']:.1f} |")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
