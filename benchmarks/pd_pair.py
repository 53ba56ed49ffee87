"""1P1D throughput on one machine: a prefill server and a decode server with the NIXL
connector, driven from the client (each request goes to P with max_tokens=1, then to D
with P's kv_transfer_params: `benchmarks.serve --prefill-url`), beside one colocated
server on the same workload. P and D get half the cores each (`--num-threads`); the
colocated server gets them all. Also the CPU each server burns while idle, before and
after the traffic (an engine waiting for work must not spin).

The defaults are the PD issue's target: the qwen3 tiny model in bf16, 64 prompts of 256
random tokens -> 64 output tokens (EOS ignored), concurrency 8.

    python -m benchmarks.pd_pair [--arch qwen3] [--no-colocated]
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

from benchmarks import serve
from benchmarks.serve_targets import ARCHS, start_server
from launch import deployment_secret, free_port, pd_command, stop_process

IDLE_WINDOW_S = 5.0


def process_tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and every descendant still running (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0.0, [pid]
    ticks = os.sysconf("SC_CLK_TCK")
    while todo:
        current = todo.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        todo += children.get(current, [])
    return total


def idle_cpu_percent(pids: dict[str, int], window_s: float = IDLE_WINDOW_S) -> dict[str, float]:
    """Percent of one core each process tree used over `window_s` of no traffic."""
    before = {name: process_tree_cpu_seconds(pid) for name, pid in pids.items()}
    time.sleep(window_s)
    return {name: 100 * (process_tree_cpu_seconds(pid) - before[name]) / window_s for name, pid in pids.items()}


def run_serve(args: argparse.Namespace, base_url: str, label: str, prefill_url: str | None = None) -> dict:
    argv = ["--base-url", base_url, "--dataset", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.concurrency), "--ignore-eos", "--seed", str(args.seed), "--label", label]
    return serve.main(argv + (["--prefill-url", prefill_url] if prefill_url else []))


def row(label: str, result: dict, idle_before: dict[str, float], idle_after: dict[str, float],
        busy_cpu_s: dict[str, float]) -> dict:
    m = result["metrics"]
    server = result.get("server_metrics") or {}
    return {"config": label, "output_throughput": m["output_throughput"], "mean_ttft_ms": m["mean_ttft_ms"],
            "mean_tpot_ms": m["mean_tpot_ms"], "completed": m["completed"], "failed": m["failed"],
            "kv_bytes_read": (server.get("kv_transfer_bytes") or {}).get("total"),
            "duration_s": result["metrics"]["duration_s"], "busy_cpu_s": busy_cpu_s,
            "idle_cpu_percent_before": idle_before, "idle_cpu_percent_after": idle_after, "serve_result": result}


def bench_pd(args: argparse.Namespace, model_dir: Path, workdir: Path) -> dict:
    deployment_secret()  # shared by P and D
    p_port, d_port = free_port(), free_port()
    threads = ("--num-threads", str(max(1, (os.cpu_count() or 2) // 2)))  # the machine split between P and D
    p, _ = start_server(model_dir, p_port, args.dtype, workdir / "p.log", "--role", "prefill", *threads)
    try:
        d, _ = start_server(model_dir, d_port, args.dtype, workdir / "d.log", "--role", "decode", *threads)
        try:
            pids = {"P": p.pid, "D": d.pid}
            idle_before = idle_cpu_percent(pids)
            busy = {name: process_tree_cpu_seconds(pid) for name, pid in pids.items()}
            result = run_serve(args, f"http://127.0.0.1:{d_port}", "1P1D", f"http://127.0.0.1:{p_port}")
            busy = {name: process_tree_cpu_seconds(pid) - busy[name] for name, pid in pids.items()}
            idle_after = idle_cpu_percent(pids)
        finally:
            stop_process(d.process)
    finally:
        stop_process(p.process)
    return row("1P1D (NIXL, client-driven)", result, idle_before, idle_after, busy)


def bench_colocated(args: argparse.Namespace, model_dir: Path, workdir: Path) -> dict:
    port = free_port()
    server, _ = start_server(model_dir, port, args.dtype, workdir / "colocated.log")
    try:
        idle_before = idle_cpu_percent({"colocated": server.pid})
        busy = process_tree_cpu_seconds(server.pid)
        result = run_serve(args, f"http://127.0.0.1:{port}", "colocated")
        busy = {"colocated": process_tree_cpu_seconds(server.pid) - busy}
        idle_after = idle_cpu_percent({"colocated": server.pid})
    finally:
        stop_process(server.process)
    return row("colocated (1 server)", result, idle_before, idle_after, busy)


def _idle(values: dict[str, float]) -> str:
    return ", ".join(f"{name} {pct:.1f}%" for name, pct in values.items())


def format_table(rows: list[dict]) -> str:
    lines = ["| config | output tok/s | mean TTFT (ms) | mean TPOT (ms) | completed | failed | KV bytes read | "
             "CPU s in the run (wall s) | idle CPU before | idle CPU after |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kv = f"{r['kv_bytes_read'] / 2**20:.1f} MiB" if r["kv_bytes_read"] else "-"
        lines.append(f"| {r['config']} | {r['output_throughput']:.1f} | {r['mean_ttft_ms']:.1f} | "
                     f"{r['mean_tpot_ms']:.2f} | {r['completed']} | {r['failed']} | {kv} | "
                     f"{', '.join(f'{n} {v:.1f}' for n, v in r['busy_cpu_s'].items())} ({r['duration_s']:.1f}) | "
                     f"{_idle(r['idle_cpu_percent_before'])} | {_idle(r['idle_cpu_percent_after'])} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pd_pair", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=ARCHS, default="qwen3", help="tiny model to serve (default qwen3)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                   help="model dtype (default bfloat16)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per configuration (default 64)")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (default 256)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens, EOS ignored (default 64)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    p.add_argument("--no-colocated", dest="colocated", action="store_false",
                   help="skip the colocated reference run")
    p.add_argument("--output", type=Path, default=Path("results/pd_pair.json"), help="JSON results file")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_dir = workdir / args.arch
        subprocess.run(pd_command("make-model", "--arch", args.arch, "--out", str(model_dir)), check=True,
                       stdout=subprocess.DEVNULL)
        rows = [bench_pd(args, model_dir, workdir)]
        if args.colocated:
            rows.append(bench_colocated(args, model_dir, workdir))
    print(f"\n{args.arch} {args.dtype}, {args.num_prompts} x ({args.input_len} -> {args.output_len}) tokens, "
          f"concurrency {args.concurrency}, {os.cpu_count()} CPUs; idle CPU over {IDLE_WINDOW_S:g} s, "
          "in % of one core (server + engine process):")
    print(format_table(rows))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"parameters": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
                                      indent=2) + "\n")
    print(f"Wrote {args.output}")
    return rows


if __name__ == "__main__":
    main()
