"""Micro-benchmark of the KV cache manager's per-request bookkeeping.

Per request: `get_computed_blocks` (which computes the request's block hashes,
incrementally, inside the call) + `allocate_slots` for the whole prompt at once +
`cache_blocks` once the prompt counts as computed + `free`.
Requests run one after another over a synthetic trace in which half the prompts share one
prefix, for three layouts built by `make_kv_cache_config`, each with prefix caching on and
off. No model, no tensors: this times the Python bookkeeping the scheduler pays per request.

    python -m benchmarks.kv_manager --num-requests 1000 --output results/kv_manager.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from pd.contracts.request import Request
from pd.kv_cache.kv_cache_manager import KVCacheManager
from pd.kv_cache.layout import make_kv_cache_config
from pd.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
)

VOCAB_SIZE = 32000
NUM_WARMUP = 20
# The KV budget holds this many whole prompts: the shared prefix survives runs of up to 3
# unshared prompts (a run of 4 evicts it; ~6% of shared prompts at the defaults).
REQUESTS_IN_MEMORY = 4
SLIDING_WINDOW = 512
LARGE_MEMORY = 1 << 40  # only to learn a layout's row bytes before sizing the real budget
TIMED_OPS = (
    "get_computed_blocks (incl. incremental block-hash computation) + "
    "allocate_slots(whole prompt) + cache_blocks + free; "
    "with prefix caching off no hash is computed"
)

LayerSpecs = dict[str, KVCacheSpec]


@dataclass(frozen=True)
class Layout:
    name: str
    make_specs: Callable[[int], LayerSpecs]  # configured block size -> per-layer specs


def _attention(block_size: int, sliding: bool = False) -> KVCacheSpec:
    common = dict(block_size=block_size, num_kv_heads=8, head_size=128, dtype="bfloat16")
    if sliding:
        return SlidingWindowSpec(**common, sliding_window=SLIDING_WINDOW)
    return FullAttentionSpec(**common)


def full_attention_specs(block_size: int) -> LayerSpecs:
    return {f"layers.{i}": _attention(block_size) for i in range(4)}


def gemma3_like_specs(block_size: int) -> LayerSpecs:
    """12 layers: 5 sliding-window layers then 1 full-attention layer, twice."""
    return {f"layers.{i}": _attention(block_size, sliding=i % 6 != 5) for i in range(12)}


def bamba_like_specs(block_size: int) -> LayerSpecs:
    """12 layers: full attention every 6th layer, sliding window on 2, Mamba on the rest."""
    mamba = MambaSpec(
        block_size=block_size,
        num_heads=16,
        head_dim=64,
        state_size=64,
        n_groups=1,
        conv_width=3,
        conv_dtype="bfloat16",
        ssm_dtype="float32",
    )

    def spec(i: int) -> KVCacheSpec:
        if i % 6 == 5:
            return _attention(block_size)
        return _attention(block_size, sliding=True) if i in (2, 8) else mamba

    return {f"layers.{i}": spec(i) for i in range(12)}


LAYOUTS = (
    Layout("1 group (full attention)", full_attention_specs),
    Layout("full+sliding 1:5 (Gemma3-like)", gemma3_like_specs),
    Layout("full+sliding+Mamba", bamba_like_specs),
)


def make_config(specs: LayerSpecs, prompt_len: int) -> KVCacheConfig:
    """A config whose pool holds REQUESTS_IN_MEMORY whole prompts (+ the null block).

    A whole-prompt allocation of a new request takes a block per position in every
    group (nothing is skippable before anything is computed), so that is the size of
    one request here, not the one-token minimum `make_kv_cache_config` checks.
    """
    probe = make_kv_cache_config(specs, LARGE_MEMORY)
    per_request = sum(cdiv(prompt_len, g.spec.block_size) for g in probe.groups)
    memory = (REQUESTS_IN_MEMORY * per_request + 1) * probe.cross_layer_page_bytes
    return make_kv_cache_config(specs, memory, max_model_len=prompt_len)


def make_trace(
    num_requests: int, prompt_len: int, prefix_len: int, seed: int
) -> list[list[int]]:
    """Prompts of `prompt_len` random tokens; a seeded random half start with one shared
    prefix of `prefix_len` tokens."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(VOCAB_SIZE) for _ in range(n)]

    prefix = tokens(prefix_len)
    shared = set(rng.sample(range(num_requests), num_requests // 2))
    return [
        prefix + tokens(prompt_len - prefix_len) if i in shared else tokens(prompt_len)
        for i in range(num_requests)
    ]


def run_trace(manager: KVCacheManager, prompts: Sequence[list[int]], tag: str) -> list[int]:
    """Serve each prompt in turn; returns nanoseconds per request. Requests are created
    fresh (untimed) so no block hash carries over from an earlier run."""
    timings = []
    for i, prompt in enumerate(prompts):
        request = Request(f"{tag}-{i}", prompt)
        start = time.perf_counter_ns()
        blocks, num_hit = manager.get_computed_blocks(request)
        new_blocks = manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, blocks)
        request.num_computed_tokens = request.num_tokens  # the prefill step ran
        manager.cache_blocks(request, request.num_computed_tokens)
        manager.free(request)
        timings.append(time.perf_counter_ns() - start)
        if new_blocks is None:
            raise RuntimeError(f"request {request.request_id} did not fit in the KV cache")
    manager.check_integrity()
    if manager.usage != 0:
        raise RuntimeError(f"{manager.usage:.1%} of the KV cache still held after the run")
    return timings


def summarize(timings_ns: Sequence[int]) -> dict[str, float]:
    us = [t / 1000 for t in timings_ns]
    percentiles = statistics.quantiles(us, n=100, method="inclusive")
    return {
        "mean_us": statistics.fmean(us),
        "p50_us": percentiles[49],
        "p99_us": percentiles[98],
        "min_us": min(us),
        "max_us": max(us),
        "total_ms": sum(us) / 1000,
    }


def describe_groups(config: KVCacheConfig) -> str:
    kinds = {FullAttentionSpec: "full", SlidingWindowSpec: "sliding", MambaSpec: "mamba"}
    counts = Counter(kinds[type(g.spec)] for g in config.groups)
    return f"{len(config.groups)} (" + ", ".join(f"{n} {k}" for k, n in counts.items()) + ")"


def bench_layout(
    layout: Layout, prompts: Sequence[list[int]], args: argparse.Namespace, caching: bool
) -> dict:
    config = make_config(layout.make_specs(args.block_size), args.prompt_len)
    run_trace(KVCacheManager(config, enable_caching=caching), prompts[:NUM_WARMUP], "warmup")
    manager = KVCacheManager(config, enable_caching=caching, max_model_len=args.prompt_len)
    timings = run_trace(manager, prompts, "req")
    return {
        "config": layout.name,
        "groups": describe_groups(config),
        "num_groups": len(config.groups),
        "block_sizes": list(config.block_sizes),
        "num_blocks": config.num_blocks,
        "prefix_caching": caching,
        "hit_rate": manager.stats.hit_rate,
        **summarize(timings),
    }


def format_table(rows: Sequence[dict]) -> str:
    header = (
        "| config | groups | block size | prefix caching | mean µs/request | p50 µs | p99 µs "
        "| prefix hit rate |"
    )
    lines = [header, "|" + "---|" * 8]
    for r in rows:
        block_sizes = "/".join(str(b) for b in r["block_sizes"])
        lines.append(
            f"| {r['config']} | {r['groups']} | {block_sizes} | "
            f"{'on' if r['prefix_caching'] else 'off'} | {r['mean_us']:.1f} | "
            f"{r['p50_us']:.1f} | {r['p99_us']:.1f} | {r['hit_rate']:.3f} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--num-requests", type=int, default=1000, help="timed requests per configuration")
    add("--prompt-len", type=int, default=2048, help="tokens per prompt")
    add("--prefix-len", type=int, default=1024, help="tokens shared by half the prompts")
    add("--block-size", type=int, default=16, help="configured block size in tokens")
    add("--seed", type=int, default=0, help="seed of the synthetic trace")
    add("--output", type=Path, default=Path("results/kv_manager.json"), help="JSON results file")
    args = p.parse_args(argv)
    if args.num_requests < 2 or args.prompt_len < 2 or args.block_size < 1:
        p.error("--num-requests and --prompt-len must be >= 2, --block-size >= 1")
    if not 0 <= args.prefix_len <= args.prompt_len:
        p.error("--prefix-len must be between 0 and --prompt-len")
    return args


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    prompts = make_trace(args.num_requests, args.prompt_len, args.prefix_len, args.seed)
    rows = [
        bench_layout(layout, prompts, args, caching)
        for layout in LAYOUTS
        for caching in (True, False)
    ]
    print(f"Timed per request: {TIMED_OPS}; sequential, {args.num_requests} requests.")
    print(format_table(rows))
    result = {
        "timed": TIMED_OPS,
        "parameters": {
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "vocab_size": VOCAB_SIZE,
            "num_warmup": NUM_WARMUP,
            "requests_in_memory": REQUESTS_IN_MEMORY,
            "sliding_window": SLIDING_WINDOW,
        },
        "environment": {
            "python": sys.version,
            "implementation": platform.python_implementation(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
        },
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"Wrote {args.output}")
    return rows


if __name__ == "__main__":
    main()
