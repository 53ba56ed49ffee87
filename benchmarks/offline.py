"""Offline generation throughput: pd.LLM against transformers' `generate`.

For each tiny architecture (`pd make-model`), batch size and engine, the same random
prompts of `--input-len` tokens generate exactly `--output-len` greedy tokens (EOS
ignored). Reported: generated tokens per second (batch * output-len / wall time of the
whole generate call, prefill included), after one warm-up call per configuration.

    python -m benchmarks.offline --batch-sizes 1 8 32 --output results/offline.json
    python -m benchmarks.offline --model MODEL.gguf --dtype bfloat16 --batch-sizes 32
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch

from pd.contracts.sampling_params import SamplingParams
from pd.llm import LLM
from pd.models.make_model import make_model

ARCHS = ("qwen3", "gemma3", "bamba", "granitehybrid")


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (batch, length), generator=gen).tolist()


def time_pd(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], params)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == output_len for o in outputs)
    return elapsed


def time_transformers(model, prompts: list[list[int]], output_len: int) -> float:
    ids = torch.tensor(prompts)

    def generate(batch: torch.Tensor) -> torch.Tensor:
        return model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=output_len,
                              min_new_tokens=output_len, do_sample=False, pad_token_id=0)

    with torch.inference_mode():
        generate(ids[:1])  # warm-up
        start = time.perf_counter()
        out = generate(ids)
        elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + output_len
    return elapsed


def load_transformers(model: Path, dtype: str):
    """transformers' model of the same checkpoint (a .gguf through `gguf_file=`)."""
    from transformers import AutoModelForCausalLM

    if model.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(model.parent, gguf_file=model.name,
                                                    dtype=getattr(torch, dtype)).eval()
    return AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()


def bench_model(name: str, model: Path, args: argparse.Namespace) -> list[dict]:
    llm = LLM(str(model), dtype=args.dtype, max_num_seqs=max(args.batch_sizes),
              kv_cache_memory=args.kv_cache_memory, device="cpu")
    engines = {}
    if not args.skip_transformers:
        hf = load_transformers(model, args.dtype)
        engines["transformers"] = lambda prompts: time_transformers(hf, prompts, args.output_len)
    engines["pd"] = lambda prompts: time_pd(llm, prompts, args.output_len)
    rows = []
    for engine, run in engines.items():
        for batch in args.batch_sizes:
            prompts = random_prompts(batch, args.input_len, llm.engine.model_config.vocab_size, args.seed)
            elapsed = run(prompts)
            rows.append({"arch": name, "engine": engine, "batch": batch, "seconds": elapsed,
                         "output_tokens_per_s": batch * args.output_len / elapsed})
            print(f"  {name:14s} {engine:12s} batch {batch:3d}: {rows[-1]['output_tokens_per_s']:8.1f} tok/s",
                  flush=True)
    return rows


def format_table(rows: list[dict], batch_sizes: Sequence[int]) -> str:
    engines = sorted({r["engine"] for r in rows}, key=lambda e: e != "pd")
    header = "| model | engine | " + " | ".join(f"batch {b} (tok/s)" for b in batch_sizes) + " |"
    lines = [header, "|" + "---|" * (2 + len(batch_sizes))]
    for arch in dict.fromkeys(r["arch"] for r in rows):
        for engine in engines:
            cells = [next((f"{r['output_tokens_per_s']:.1f}" for r in rows if r["arch"] == arch
                           and r["engine"] == engine and r["batch"] == b), "-") for b in batch_sizes]
            lines.append(f"| {arch} | {engine} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", nargs="+", choices=ARCHS, default=list(ARCHS), help="tiny architectures to run")
    p.add_argument("--model", type=Path, default=None,
                   help="a real checkpoint (HF folder or .gguf) to run instead of the tiny architectures")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32], help="prompts per generate call")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per prompt")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="model dtype")
    p.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="pd KV cache bytes")
    p.add_argument("--seed", type=int, default=0, help="seed of the model weights and prompts")
    p.add_argument("--skip-transformers", action="store_true", help="time pd only")
    p.add_argument("--output", type=Path, default=Path("results/offline.json"), help="JSON results file")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    rows: list[dict] = []
    if args.model is not None:
        rows += bench_model(args.model.name, args.model, args)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for arch in args.archs:
                rows += bench_model(arch, make_model(arch, Path(tmp) / arch, seed=args.seed), args)
    print(f"Generated tokens/s, {args.input_len}-token prompts -> {args.output_len} tokens, {args.dtype}, "
          f"{torch.get_num_threads()} threads:")
    print(format_table(rows, args.batch_sizes))
    result = {"parameters": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "environment": {"platform": platform.platform(), "torch": torch.__version__,
                              "threads": torch.get_num_threads()},
              "rows": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"Wrote {args.output}")
    return rows


if __name__ == "__main__":
    main()
