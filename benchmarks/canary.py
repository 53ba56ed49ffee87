"""The PD canary (`pd proxy --canary-fraction`) on a 1P1D deployment of one model.

    python -m benchmarks.canary --model M [--requests 200]            # agreement
    python -m benchmarks.canary --model M --latency [--fraction 0.05]   # what it costs

**Agreement**: a proxy with `--canary-fraction 1` in front of one prefill and one decode
server; `--requests` greedy requests (random token-id prompts of 16-400 tokens, 16 new
tokens, `--concurrency` at a time): every one is run again alone and compared. Prints
the outcomes (match, tie, mismatch, error, skipped).

**Latency**: two proxies in front of the same servers, one with the canary off and one
with `--fraction`; as many requests through each in turn (prompts of their own each time:
none finds another run's in a cache), `--repeats` rounds, each proxy first in every other
round. Prints each round's median and p99 client latency per
proxy and the median ratios (canary / off): within noise is what a default may cost.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shlex
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from launch import deployment_secret, free_port, http_client, pd_command, running

RESULTS = ("match", "tie", "mismatch", "error", "skipped")


def bodies(count: int, seed: int, new_tokens: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": [rng.randrange(300, 3000) for _ in range(rng.randrange(16, 400))], "max_tokens": new_tokens,
             "temperature": 0, "ignore_eos": True} for _ in range(count)]


def send_all(url: str, requests: list[dict], concurrency: int) -> list[float]:
    """Each request through `url`, `concurrency` at a time; their latencies (s), sorted."""
    latencies, lock, left = [], threading.Lock(), iter(requests)

    def client() -> None:
        http = http_client()
        while True:
            with lock:
                body = next(left, None)
            if body is None:
                return
            start = time.perf_counter()
            response = http.post(f"{url}/v1/completions", json=body, timeout=600)
            response.raise_for_status()
            with lock:
                latencies.append(time.perf_counter() - start)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sorted(latencies)


def outcomes(proxy_url: str) -> dict[str, float]:
    text = http_client().get(f"{proxy_url}/metrics", timeout=10).text
    out = dict.fromkeys(RESULTS, 0.0)
    for line in text.splitlines():
        for result in RESULTS:
            if line.startswith(f'pd_proxy_canary_total{{result="{result}"}} '):
                out[result] = float(line.rpartition(" ")[2])
    return out


def settled(proxy_url: str, expected: int, timeout_s: float = 600) -> dict[str, float]:
    """The outcomes once `expected` canaries ended (or the time ran out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = outcomes(proxy_url)
        if sum(counts.values()) >= expected or time.monotonic() > deadline:
            return counts
        time.sleep(0.2)


def proxy(servers: tuple[str, str], logs: Path, name: str, *flags: str):
    port = free_port()
    return running(pd_command("proxy", "--host", "127.0.0.1", "--port", str(port), "--prefill", servers[0],
                              "--decode", servers[1], *flags), f"http://127.0.0.1:{port}", logs / f"{name}.log",
                   ready=lambda status: status in (200, 503))


def agreement(servers: tuple[str, str], logs: Path, args: argparse.Namespace) -> dict:
    with proxy(servers, logs, "proxy-canary", "--canary-fraction", "1", "--canary-max-inflight", "64") as front:
        send_all(front.url, bodies(args.requests, args.seed, args.new_tokens), args.concurrency)
        counts = settled(front.url, args.requests)
    print(f"{args.requests} greedy requests, every one run again alone: " +
          ", ".join(f"{k} {int(v)}" for k, v in counts.items()))
    return {"requests": args.requests, "outcomes": counts}


def latency(servers: tuple[str, str], logs: Path, args: argparse.Namespace) -> dict:
    rounds = []
    with proxy(servers, logs, "proxy-off") as off, proxy(servers, logs, "proxy-canary", "--canary-fraction",
                                                           str(args.fraction)) as on:
        send_all(off.url, bodies(4, args.seed - 1, args.new_tokens), 1)  # warm: both servers' first steps
        for i in range(args.repeats):
            order = [("off", off), ("canary", on)][::1 if i % 2 else -1]
            figures = {}
            for j, (name, front) in enumerate(order):  # prompts of their own: no run finds another's cached
                times = send_all(front.url, bodies(args.requests, args.seed + 2 * i + j, args.new_tokens),
                                 args.concurrency)
                figures[name] = {"p50_ms": 1000 * statistics.median(times),
                                 "p99_ms": 1000 * times[min(len(times) - 1, int(0.99 * len(times)))]}
            rounds.append(figures)
            print(f"round {i}: off p50 {figures['off']['p50_ms']:.0f} p99 {figures['off']['p99_ms']:.0f} ms; "
                  f"canary {args.fraction:g} p50 {figures['canary']['p50_ms']:.0f} "
                  f"p99 {figures['canary']['p99_ms']:.0f} ms")
        counts = outcomes(on.url)
    ratios = {q: statistics.median(r["canary"][f"{q}_ms"] / r["off"][f"{q}_ms"] for r in rounds)
              for q in ("p50", "p99")}
    print(f"median ratios canary / off: p50 {ratios['p50']:.3f}, p99 {ratios['p99']:.3f}; canaries: " +
          ", ".join(f"{k} {int(v)}" for k, v in counts.items()))
    return {"fraction": args.fraction, "rounds": rounds, "median_ratios": ratios, "outcomes": counts}


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.canary", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="what P and D serve")
    parser.add_argument("--requests", type=int, default=200, help="requests (per round with --latency; default 200)")
    parser.add_argument("--new-tokens", type=int, default=16, help="max_tokens of each (default 16)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests at a time (default 4)")
    parser.add_argument("--latency", action="store_true", help="measure client latency with the canary off and on")
    parser.add_argument("--fraction", type=float, default=0.05, help="--canary-fraction with --latency (default 0.05)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds with --latency (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="of the prompts (default 0)")
    parser.add_argument("--server-args", default="--num-threads 1",
                        help="more flags for both pd serve (default %(default)s: a core each)")
    parser.add_argument("--output", type=Path, help="also write the figures here as JSON")
    args = parser.parse_args(argv)
    deployment_secret()  # P and D share it (they inherit the environment)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        logs = Path(tmp)
        ports = free_port(), free_port()
        p, d = (stack.enter_context(running(
                    pd_command("serve", "--host", "127.0.0.1", "--port", str(port), "--model", args.model, "--role",
                               role, *shlex.split(args.server_args)),
                    f"http://127.0.0.1:{port}", logs / f"{role}.log", ready=lambda status: status == 200))
                for port, role in zip(ports, ("prefill", "decode")))
        servers = (p.url, d.url)
        result = latency(servers, logs, args) if args.latency else agreement(servers, logs, args)
    if args.output:
        args.output.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
