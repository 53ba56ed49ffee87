"""What one request of many sequences costs the others: short requests' latency beside one
request of n sequences, against beside one request of one sequence (the fair share by
request: a request is one request, however many sequences it asks for).

    python -m benchmarks.fair_share --model M [--n 128] [--repeats 3] [--server-args "..."]

One `pd serve` of M. Each repetition, interleaved: the long request (n = 1, then n =
`--n`, best_of as n, `--long-tokens` tokens, temperature 1, streamed to a process of its
own so that reading its stream takes nothing from the clients here) runs alone for
`--settle` seconds, then `--clients` clients send `--requests` short requests
(`--short-tokens` tokens each) and the long one is stopped. Prints, per repetition and as
medians, the short requests' p50 and p99 latency beside each, and the ratios n / 1.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from launch import free_port, http_client, pd_command, running

SHORT_PROMPT = "Question {k}: what is the capital of France? Answer:"
STREAM = """import sys, httpx
with httpx.stream("POST", sys.argv[1], content=sys.argv[2], headers={"Content-Type": "application/json"},
                  timeout=None) as response:
    for _ in response.iter_bytes():
        pass
"""  # the long request, read to nothing in a process of its own


def short_latencies(url: str, requests: int, clients: int, tokens: int) -> list[float]:
    """Seconds each of `requests` short completions took, `clients` at a time, sorted."""
    latencies: list[float] = []
    lock = threading.Lock()
    left = iter(range(requests))

    def client(k: int) -> None:
        http = http_client()
        while True:
            with lock:
                if next(left, None) is None:
                    return
            body = {"prompt": SHORT_PROMPT.format(k=k), "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
            start = time.perf_counter()
            response = http.post(f"{url}/v1/completions", json=body, timeout=600)
            response.raise_for_status()
            with lock:
                latencies.append(time.perf_counter() - start)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sorted(latencies)


def quantile(values: Sequence[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def beside(url: str, n: int, args: argparse.Namespace) -> dict[str, float]:
    """The short requests' p50 and p99 (ms) while a request of `n` sequences streams."""
    body = json.dumps({"prompt": "Once upon a time", "n": n, "best_of": n, "max_tokens": args.long_tokens,
                       "temperature": 1.0, "ignore_eos": True, "stream": True})
    long = subprocess.Popen([sys.executable, "-c", STREAM, f"{url}/v1/completions", body])
    try:
        time.sleep(args.settle)
        latencies = short_latencies(url, args.requests, args.clients, args.short_tokens)
    finally:
        long.terminate()
        long.wait()
    time.sleep(1.0)  # the long request aborted
    return {"p50_ms": 1000 * quantile(latencies, 0.5), "p99_ms": 1000 * quantile(latencies, 0.99)}


def run(url: str, args: argparse.Namespace) -> dict:
    short_latencies(url, 4, 1, args.short_tokens)  # warm
    reps = []
    for _ in range(args.repeats):
        one, many = beside(url, 1, args), beside(url, args.n, args)
        reps.append({"one": one, "many": many, "ratio_p50": many["p50_ms"] / one["p50_ms"],
                     "ratio_p99": many["p99_ms"] / one["p99_ms"]})
    medians = {key: statistics.median(r[key] for r in reps) for key in ("ratio_p50", "ratio_p99")}
    return {"n": args.n, "repetitions": reps, "median": medians}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fair_share", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the model pd serve serves")
    parser.add_argument("--n", type=int, default=128, help="sequences (and best_of) of the long request (default 128)")
    parser.add_argument("--long-tokens", type=int, default=4000, help="max_tokens of the long request (default 4000)")
    parser.add_argument("--short-tokens", type=int, default=4, help="max_tokens of each short request (default 4)")
    parser.add_argument("--requests", type=int, default=40, help="short requests beside each long one (default 40)")
    parser.add_argument("--clients", type=int, default=2, help="short requests at a time (default 2)")
    parser.add_argument("--settle", type=float, default=3.0,
                        help="seconds the long request runs alone first (default 3)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions (default 3)")
    parser.add_argument("--server-args", default="--num-threads 2",
                        help="more flags for pd serve (default %(default)s)")
    parser.add_argument("--output", type=Path, help="also write the figures here as JSON")
    args = parser.parse_args(argv)
    port = free_port()
    with tempfile.TemporaryDirectory() as logs, running(
            pd_command("serve", "--host", "127.0.0.1", "--port", str(port), "--model", args.model,
                       *shlex.split(args.server_args)),
            f"http://127.0.0.1:{port}", Path(logs) / "server.log", ready=lambda status: status == 200) as server:
        figures = run(server.url, args)
    for i, rep in enumerate(figures["repetitions"]):
        print(f"rep {i}: beside n=1 p50 {rep['one']['p50_ms']:.0f} p99 {rep['one']['p99_ms']:.0f} ms; beside "
              f"n={args.n} p50 {rep['many']['p50_ms']:.0f} p99 {rep['many']['p99_ms']:.0f} ms; ratios "
              f"p50 {rep['ratio_p50']:.2f} p99 {rep['ratio_p99']:.2f}")
    print(f"median ratios: p50 {figures['median']['ratio_p50']:.2f}, p99 {figures['median']['ratio_p99']:.2f}")
    if args.output:
        args.output.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
