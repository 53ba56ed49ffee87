"""The deployments `pd bench compare` launches on this machine, and the prefix-cache and
KV-transfer figures read from all their servers' /metrics around a run.

- `colocated`: one `pd serve` doing prefill and decode, all cores;
- `no-prefix-cache`: `colocated` with prefix caching off;
- `colocated-tp2`: `colocated` with the model sharded over two tensor-parallel ranks,
  the cores split between them;
- `pd`: a prefill and a decode server (NIXL, canonical layout) behind `pd proxy`, the
  cores split between them; `pd-per-layer`: with the per-layer KV layout on both;
  `pd-no-skip-partial`: with `--no-skip-partial-groups-on-remote-prefill` on the decode server;
  `pd-decode-tp2`: with the decode server's model sharded over two tensor-parallel ranks
  (a narrow P, a wide D: each D rank reads its heads from P's one rank);
  `pd-conditional`: `pd` behind `pd proxy --disagg-policy conditional`, the decode
  server publishing KV events (it prefills itself the requests it lacks little of, and
  the prefill server reads from it what it holds of the others);
  `pd-conditional-no-reuse`: the same with `--reuse-min-tokens 0` (P never reads from D);
- `2p2d-round_robin`, `2p2d-prefix_aware`, `2p2d-kv_aware`: two prefill and two decode
  servers behind `pd proxy --policy ...` (kv_aware: the servers publish KV events);
  `2p2d-conditional`: `2p2d-kv_aware` with `--disagg-policy conditional`;
  `2p2d-conditional-no-reuse`: with `--reuse-min-tokens 0` as well;
- `colocated-disk-tier`: `colocated` with a disk tier (`--kv-offload-disk-path`, a new
  directory each run, so that every run starts cold); `colocated-unbounded-cache`:
  `colocated` with a KV cache of 4 GiB (the hit rate a tier can at best reach);
- `1p1d-all-cache`: `pd` whose one prefill server has the KV cache of the 2P2D
  deployments' two (`--prefill-kv-cache-memory` x 2): the prefix-cache hit rate the
  2P2D routing policies can at best reach.

`--prefill-kv-cache-memory` sizes each prefill server's KV cache in every PD deployment,
so that a workload can hold more prefixes than one server's cache.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

import launch
from benchmarks.serve_metrics import Samples, counter_deltas, parse_prometheus, server_metric_deltas
from launch import free_port, pd_command, stop_process

UNBOUNDED_CACHE = str(4 << 30)  # KV cache bytes: every prefix of the workloads compared (~230k Gemma 3 tokens)
COLOCATED = {"colocated": [], "no-prefix-cache": ["--no-enable-prefix-caching"],
             "colocated-disk-tier": [],  # and a directory of its own (`deploy`)
             "colocated-unbounded-cache": ["--kv-cache-memory", UNBOUNDED_CACHE],
             "colocated-tp2": ["--tensor-parallel-size", "2",
                               "--num-threads", str(max(1, (os.cpu_count() or 2) // 2))]}
ROUTED = {"2p2d-round_robin": "round_robin", "2p2d-prefix_aware": "prefix_aware", "2p2d-kv_aware": "kv_aware",
          "2p2d-conditional": "kv_aware", "2p2d-conditional-no-reuse": "kv_aware"}
CONDITIONAL = ("pd-conditional", "2p2d-conditional", "pd-conditional-no-reuse", "2p2d-conditional-no-reuse")
NO_REUSE = "-no-reuse"  # a conditional configuration whose prefill servers never read from decode servers
CONFIGS = ("colocated", "pd", "pd-per-layer", "pd-no-skip-partial", "no-prefix-cache", *ROUTED, "1p1d-all-cache",
           "colocated-tp2", "pd-decode-tp2", "pd-conditional", "pd-conditional-no-reuse", "colocated-disk-tier",
           "colocated-unbounded-cache")
ROUTED_PREFILL_SERVERS = 2
PATHS = "pd_proxy_requests_by_path_total"  # the proxy's requests by where their prompt was computed


@dataclass
class Deployment:
    """What `bench serve` talks to (the front URL, a decoding server's metrics) and
    every prefill and decode server's base URL (a colocated server is both)."""

    base_url: str
    metrics_url: str
    prefill_urls: list[str] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)
    proxy_url: str | None = None  # a PD deployment's


@contextlib.contextmanager
def deploy(config: str, args: argparse.Namespace, workdir: Path) -> Iterator[Deployment]:
    """Launch one configuration (its prefill and decode servers sharing a transfer
    secret); everything it started is stopped on exit."""
    launch.deployment_secret()
    common = ["--model", str(args.model), "--dtype", args.dtype, "--host", "127.0.0.1", *shlex.split(args.server_args)]
    with contextlib.ExitStack() as stack:
        def start(name: str, *extra: str, command: str = "serve", shared: list[str] = common) -> str:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            server = launch.start(pd_command(command, *shared, "--port", str(port), *extra), url,
                                  workdir / f"{config}-{name}.log")
            stack.callback(stop_process, server.process)
            return url

        if config in COLOCATED:
            tier = ["--kv-offload-disk-path", str(_fresh_dir(workdir / f"{config}-tier"))] \
                if config == "colocated-disk-tier" else []
            url = start("server", *COLOCATED[config], *tier)
            yield Deployment(url, f"{url}/metrics", [url], [url])
            return
        pairs = ROUTED_PREFILL_SERVERS if config in ROUTED else 1
        threads = ["--num-threads", str(max(1, (os.cpu_count() or 2) // (2 * pairs)))]
        prefill, decode = _server_flags(config, args)
        routed = ROUTED.get(config) == "kv_aware"  # the proxy follows P's events, and D's under conditional
        ps = [start(f"prefill{i}", "--role", "prefill", *threads, *prefill, *_events(routed)) for i in range(pairs)]
        ds = [start(f"decode{i}", "--role", "decode", *threads, *decode, *_events(routed or config in CONDITIONAL))
              for i in range(pairs)]
        disagg = ["--disagg-policy", "conditional"] if config in CONDITIONAL else []
        if config.endswith(NO_REUSE):
            disagg += ["--reuse-min-tokens", "0"]
        proxy = start("proxy", "--prefill", *ps, "--decode", *ds, "--policy", ROUTED.get(config, "round_robin"),
                      *disagg, "--log-level", "warning", *shlex.split(args.proxy_args), command="proxy",
                      shared=["--host", "127.0.0.1"])
        yield Deployment(proxy, f"{ds[0]}/metrics", ps, ds, proxy)


def _fresh_dir(stem: Path) -> Path:
    """A directory no earlier run wrote (each run of a disk tier starts cold)."""
    n = 0
    while stem.with_name(f"{stem.name}-{n}").exists():
        n += 1
    return stem.with_name(f"{stem.name}-{n}")


def _events(published: bool) -> list[str]:
    """A server's flags to publish its KV events (on free ports), if `published`."""
    return ["--kv-events-port", str(free_port()), "--kv-events-replay-port", str(free_port())] if published else []


def _server_flags(config: str, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The flags of a PD configuration's prefill and decode servers."""
    layout = ["--kv-layout", "per-layer"] if config == "pd-per-layer" else []
    prefill, decode = list(layout), list(layout)
    if args.prefill_kv_cache_memory:
        scale = ROUTED_PREFILL_SERVERS if config == "1p1d-all-cache" else 1
        prefill += ["--kv-cache-memory", str(args.prefill_kv_cache_memory * scale)]
    if config == "pd-no-skip-partial":
        decode.append("--no-skip-partial-groups-on-remote-prefill")
    if config == "pd-decode-tp2":
        decode += ["--tensor-parallel-size", "2"]
    return prefill, decode


def scrape(urls: list[str]) -> list[Samples]:
    return [parse_prometheus(httpx.get(f"{url}/metrics", timeout=10).text) for url in urls]


def path_share(before: Samples | None, after: Samples | None, path: str) -> float | None:
    """Of the requests the proxy placed between two scrapes, the share that took `path`
    (`local`: its decode servers prefilled them themselves; `disaggregated+reuse`: the
    prefill server read a prefix from the decode server first); None without a proxy."""
    if before is None or after is None:
        return None
    placed = {dict(labels).get("path"): value for labels, value in counter_deltas(before, after, PATHS).items()}
    total = sum(placed.values())
    return placed.get(path, 0.0) / total if total else None


def combined_deltas(before: list[Samples], after: list[Samples]) -> dict:
    """Over several servers: prefix-cache queries, hits and hit rate (tokens, summed; a
    prompt token loaded back from an offload tier is a hit too, and `tier_hit_rate` their
    share), and KV bytes transferred (None where no server reports them)."""
    queries = hits = 0.0
    transferred = tiers = None
    for old, new in zip(before, after):
        deltas = server_metric_deltas(old, new)
        if deltas["prefix_cache"]:
            queries += deltas["prefix_cache"]["queries"]
            hits += deltas["prefix_cache"]["hits"]
        if deltas["kv_transfer_bytes"]:
            transferred = (transferred or 0.0) + deltas["kv_transfer_bytes"]["total"]
        if deltas["tier_hits"] is not None:
            tiers = (tiers or 0.0) + deltas["tier_hits"]
    return {"queries": queries, "hits": hits + (tiers or 0.0),
            "hit_rate": (hits + (tiers or 0.0)) / queries if queries else None,
            "tier_hit_rate": tiers / queries if queries and tiers is not None else None,
            "kv_transfer_bytes": transferred}
