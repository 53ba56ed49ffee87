"""Single-server throughput on the tiny models: start `pd serve`, time start-up to a
healthy /health, run `benchmarks.serve` against it, stop it; one row per model.

The defaults are the serving issue's target shapes: bf16, 64 prompts of 256 random
tokens -> 64 output tokens (EOS ignored), concurrency 8, prefix caching on. The server
is a subprocess and is reached over HTTP only.

    python -m benchmarks.serve_targets --archs qwen3 gemma3 granitehybrid
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Sequence

import launch
from benchmarks import serve
from launch import Launched, free_port, pd_command, stop_process

ARCHS = ("qwen3", "gemma3", "bamba", "granitehybrid")


def start_server(model_dir: Path, port: int, dtype: str, log: Path, *extra: str) -> tuple[Launched, float]:
    """Start `pd serve` (with `extra` flags); returns it and the seconds until /health answered 200."""
    start = time.perf_counter()
    cmd = pd_command("serve", "--model", str(model_dir), "--port", str(port), "--dtype", dtype, *extra)
    server = launch.start(cmd, f"http://127.0.0.1:{port}", log)
    return server, time.perf_counter() - start


def bench_arch(arch: str, args: argparse.Namespace, workdir: Path) -> dict:
    model_dir = workdir / arch
    subprocess.run(pd_command("make-model", "--arch", arch, "--out", str(model_dir)), check=True,
                   stdout=subprocess.DEVNULL)
    port = free_port()
    server, startup = start_server(model_dir, port, args.dtype, workdir / f"{arch}.log")
    try:
        result = serve.main([
            "--base-url", f"http://127.0.0.1:{port}", "--dataset", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
            "--ignore-eos", "--seed", str(args.seed), "--label", arch])
    finally:
        stop_process(server.process)
    m = result["metrics"]
    return {"arch": arch, "startup_s": startup, "output_throughput": m["output_throughput"],
            "completed": m["completed"], "failed": m["failed"], "mean_ttft_ms": m["mean_ttft_ms"],
            "mean_tpot_ms": m["mean_tpot_ms"], "serve_result": result}


def format_table(rows: list[dict]) -> str:
    lines = ["| model | start-up (s) | output tok/s | mean TTFT (ms) | mean TPOT (ms) | completed | failed |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['arch']} | {r['startup_s']:.2f} | {r['output_throughput']:.1f} | "
                     f"{r['mean_ttft_ms']:.1f} | {r['mean_tpot_ms']:.2f} | {r['completed']} | {r['failed']} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", nargs="+", choices=ARCHS, default=["qwen3", "gemma3", "granitehybrid"],
                   help="tiny models to serve")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="model dtype")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per model")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (EOS ignored)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    p.add_argument("--output", type=Path, default=Path("results/serve_targets.json"), help="JSON results file")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [bench_arch(arch, args, Path(tmp)) for arch in args.archs]
    print(f"\n{args.dtype}, {args.num_prompts} x ({args.input_len} -> {args.output_len}) tokens, "
          f"concurrency {args.concurrency}, {os.cpu_count()} CPUs:")
    print(format_table(rows))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    parameters = {k: str(v) for k, v in vars(args).items()}
    args.output.write_text(json.dumps({"parameters": parameters, "rows": rows}, indent=2) + "\n")
    print(f"Wrote {args.output}")
    return rows


if __name__ == "__main__":
    main()
