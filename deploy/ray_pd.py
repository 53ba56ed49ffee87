"""X prefill and Y decode `pd serve` servers as Ray actors, with `pd proxy` in front:
`python deploy/ray_pd.py --prefill X --decode Y --model DIR [--address auto] [-- SERVE FLAGS]`
(`--help` lists the flags). Every server is one `PDServer` actor that starts `pd serve`
on a free port of its node; once all answer /health the proxy runs here. Ctrl-C, SIGTERM
or the end of `--run-seconds` stops everything it started, by PID (launch/). How it
places, starts and stops servers: deploy/README.md.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from launch import Launched, pd_command
from launch.flags import parse_with_serve_args, port_number, positive_float, positive_int
from launch.process import GROUP_GRACE_S, STOP_TIMEOUT_S, keep_running, start_logged, stop_process, wait_ready
from launch.ray_actors import PDRank, PDServer, connect_ray, get_by, placed, run_deployment
from launch.signals import ignore_stop_signals
from pd.kv_transfer.signing import SECRET_ENV
from pd.models.model_config import SUPPORTED_DTYPES
from proxy.instances import POLICIES
from telemetry.progress import Progress

ROLES = ("prefill", "decode")
PROXY_READY_TIMEOUT_S = 60.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ray_pd.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run X prefill and Y decode `pd serve` servers as Ray actors with `pd proxy` in front.",
        epilog="Flags after `--` go to every `pd serve`, e.g. `-- --max-model-len 512`.")
    parser.add_argument("--prefill", type=positive_int, required=True, metavar="X",
                        help="number of prefill servers (at least 1)")
    parser.add_argument("--decode", type=positive_int, required=True, metavar="Y",
                        help="number of decode servers (at least 1)")
    parser.add_argument("--model", type=Path, required=True, metavar="DIR_OR_GGUF",
                        help="HF-format model directory or .gguf file; the same path on every Ray node")
    parser.add_argument("--address", default=None, metavar="ADDR",
                        help="Ray cluster to join, e.g. auto or HOST:6379 (default: start a local one)")
    parser.add_argument("--host", default="127.0.0.1", help="address the proxy listens on (default 127.0.0.1)")
    parser.add_argument("--port", type=port_number, default=8000, metavar="N",
                        help="TCP port of the proxy (default 8000)")
    parser.add_argument("--policy", choices=POLICIES, default="round_robin",
                        help="how the proxy picks a prefill and a decode server per request (default round_robin)")
    parser.add_argument("--num-threads", type=positive_int, default=None, metavar="T",
                        help="torch CPU threads per server (default: pd serve's; Ray sets OMP_NUM_THREADS for "
                             "its workers, which the servers inherit)")
    parser.add_argument("--dtype", choices=SUPPORTED_DTYPES, default="float32",
                        help="weights and KV cache dtype of every server (default float32)")
    parser.add_argument("--cpus-per-server", type=positive_float, default=0.5, metavar="N",
                        help="Ray CPUs each server's actor reserves per tensor-parallel rank (default 0.5)")
    parser.add_argument("--prefill-tp", type=positive_int, default=1, metavar="N",
                        help="tensor-parallel size of each prefill server (default 1)")
    parser.add_argument("--decode-tp", type=positive_int, default=1, metavar="N",
                        help="tensor-parallel size of each decode server (default 1); P and D may differ")
    parser.add_argument("--tp-span-nodes", action="store_true",
                        help="give each tensor-parallel rank a placement bundle of its own, placed PACK (one node "
                             "when they fit, several when not): rank 0 is the server's engine, each other rank a "
                             "Ray actor running `pd tp-rank` that joins it over TCP at its node's address. Default: "
                             "a server's ranks are its engine's processes, on one node (STRICT_PACK)")
    parser.add_argument("--ready-timeout", type=positive_float, default=180.0, metavar="S",
                        help="seconds the servers may take to be placed and answer /health (default 180)")
    parser.add_argument("--run-seconds", type=positive_float, default=None, metavar="S",
                        help="stop everything after this many seconds (default: run until Ctrl-C / SIGTERM)")
    parser.add_argument("--urls-file", type=Path, default=None, metavar="F",
                        help="write the proxy's and servers' URLs here as JSON once all are healthy")
    parser.add_argument("--log-dir", type=Path, default=None, metavar="D",
                        help="directory for the proxy's and servers' logs, on each node "
                             "(default: $TMPDIR/pd-ray-<this pid>)")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    return parse_with_serve_args(build_parser(), argv)


def serve_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--dtype", args.dtype]
    if args.num_threads is not None:
        flags += ["--num-threads", str(args.num_threads)]
    return flags + args.serve_args


def server_bundles(args: argparse.Namespace, tp: int, gpus_present: bool) -> list[dict[str, float]]:
    """What one server of `tp` ranks reserves (CPUs per rank, a GPU each): one bundle when
    its engine starts the ranks as processes of its own, on its node; one per rank with
    `--tp-span-nodes`."""
    ranks_per_bundle = 1 if args.tp_span_nodes else tp
    bundle = {"CPU": args.cpus_per_server * ranks_per_bundle}
    if gpus_present:
        bundle["GPU"] = float(ranks_per_bundle)
    return [bundle] * (tp // ranks_per_bundle)


def check_resources(args: argparse.Namespace) -> bool:
    """Whether the cluster has GPUs; raises if it cannot hold every server's ranks."""
    total = ray.cluster_resources()
    cpus, gpus = total.get("CPU", 0.0), total.get("GPU", 0.0)
    ranks = args.prefill * args.prefill_tp + args.decode * args.decode_tp
    if cpus < ranks * args.cpus_per_server:
        raise RuntimeError(f"the Ray cluster has {cpus:g} CPUs; {ranks} tensor-parallel ranks at --cpus-per-server "
                           f"{args.cpus_per_server:g} need {ranks * args.cpus_per_server:g}")
    if 0 < gpus < ranks:
        raise RuntimeError(f"the Ray cluster has {gpus:g} GPUs; {ranks} tensor-parallel ranks need one each")
    return gpus > 0


@dataclass
class Deployment:
    """What this script started, for the teardown: each actor (with its `start` result,
    pending or not) and the proxy."""

    starts: dict[Any, ray.ObjectRef] = field(default_factory=dict)
    ranks: dict[Any, ray.ObjectRef] = field(default_factory=dict)  # `--tp-span-nodes`: rank actors past 0
    groups: list[Any] = field(default_factory=list)  # each server's placement group
    proxy: subprocess.Popen | None = None


def launch_servers(args: argparse.Namespace, log_dir: Path, deployment: Deployment) -> None:
    """One actor per server in a placement group of its own that holds all its ranks
    (`server_bundles`), each asked to start its server (placement may wait for resources);
    with `--tp-span-nodes`, one actor per rank past 0 in the bundles after the server's,
    each joining the server once its actor has started it."""
    gpus = check_resources(args)
    model, flags = str(args.model.resolve()), serve_flags(args)
    secret = os.environ.get(SECRET_ENV) or secrets.token_hex(32)  # one per deployment
    for role, count, tp in (("prefill", args.prefill, args.prefill_tp), ("decode", args.decode, args.decode_tp)):
        bundles = server_bundles(args, tp, gpus)
        for index in range(count):
            group = placement_group(bundles, strategy="PACK" if len(bundles) > 1 else "STRICT_PACK")
            deployment.groups.append(group)
            actor = placed(PDServer, group, 0, bundles[0]).remote(
                role, index, model, [*flags, "--tensor-parallel-size", str(tp)], str(log_dir), secret,
                remote_ranks=len(bundles) > 1)
            deployment.starts[actor] = started = actor.start.remote()
            for rank in range(1, len(bundles)):
                rank_actor = placed(PDRank, group, rank, bundles[rank]).remote(rank, str(log_dir), secret)
                deployment.ranks[rank_actor] = rank_actor.start.remote(started)


def wait_for_servers(starts: dict[Any, ray.ObjectRef], timeout: float) -> list[dict[str, Any]]:
    """Each server's info (launch order) once all answer /health; raises if one exits or
    they are not all up within `timeout` s. How many are healthy is shown on stderr (a bar
    on a terminal, a few lines otherwise)."""
    deadline = time.monotonic() + timeout
    servers = get_by(list(starts.values()), deadline,
                     f"the servers' actors were not all placed within {timeout:g} s: not enough free CPUs/GPUs?")
    pending = dict(zip(starts, servers))
    with Progress("ray_pd: servers healthy", len(pending)) as progress:
        while pending:
            ready = get_by([actor.ready.remote() for actor in pending], deadline + 5, "a server stopped answering")
            progress.update(sum(map(bool, ready)))
            pending = {actor: info for (actor, info), ok in zip(pending.items(), ready) if not ok}
            if pending and time.monotonic() > deadline:
                logs = ", ".join(info["log"] for info in pending.values())
                raise RuntimeError(f"{len(pending)} server(s) not healthy after {timeout:g} s; see {logs}")
            time.sleep(0.5 if pending else 0)
    return servers


def start_proxy(args: argparse.Namespace, servers: list[dict[str, Any]], log_dir: Path) -> subprocess.Popen:
    urls = {role: [s["url"] for s in servers if s["role"] == role] for role in ROLES}
    cmd = pd_command("proxy", "--prefill", *urls["prefill"], "--decode", *urls["decode"],
                     "--host", args.host, "--port", str(args.port), "--policy", args.policy)
    return start_logged(cmd, log_dir / "proxy.log", die_with_parent=True)


def write_urls(path: Path, proxy_url: str, servers: list[dict[str, Any]], ranks: list[dict[str, Any]]) -> None:
    """Written whole (via a rename), so a reader never sees half of it."""
    urls = {"proxy": proxy_url, "prefill": [s["url"] for s in servers if s["role"] == "prefill"],
            "decode": [s["url"] for s in servers if s["role"] == "decode"], "servers": servers, "ranks": ranks}
    partial = path.with_name(f"{path.name}.partial")
    partial.write_text(json.dumps(urls, indent=2))
    partial.replace(path)


def announce(args: argparse.Namespace, proxy_url: str, servers: list[dict[str, Any]], ranks: list[dict[str, Any]],
             log_dir: Path) -> None:
    print(f"ray_pd: {args.prefill}P{args.decode}D up on Ray ({args.address or 'local cluster'})")
    print(f"  proxy:   {proxy_url}  (log {log_dir / 'proxy.log'})")
    for s in servers:
        print(f"  {s['role'] + ':':8} {s['url']}  (pid {s['pid']} on {s['node_ip']}, log {s['log']})")
    for r in ranks:
        print(f"    rank {r['rank']} of {r['server']}  (pid {r['pid']} on {r['node_ip']}, log {r['log']})")
    until = f"for {args.run_seconds:g} s" if args.run_seconds else "until Ctrl-C / SIGTERM"
    print(f"ray_pd: serving {until}; then everything stops", flush=True)


def stop_actors(starts: dict[Any, ray.ObjectRef]) -> None:
    """`stop()` every actor that started its server and wait (bounded); then kill every actor."""
    started = [actor for actor, ref in starts.items() if ray.wait([ref], timeout=0)[0]]
    with contextlib.suppress(ray.exceptions.RayError):
        ray.get([actor.stop.remote() for actor in started], timeout=STOP_TIMEOUT_S + GROUP_GRACE_S + 10)
    for actor in starts:  # an actor not placed yet has no server; a killed one SIGTERMs its own
        with contextlib.suppress(ray.exceptions.RayError, ValueError):
            ray.kill(actor, no_restart=True)


def teardown(deployment: Deployment) -> None:
    ignore_stop_signals()
    print("ray_pd: stopping the proxy and every server", flush=True)
    if deployment.proxy is not None:
        stop_process(deployment.proxy)
    if ray.is_initialized():
        stop_actors(deployment.starts)
        stop_actors(deployment.ranks)  # each ended with its server already; their actors go
        for group in deployment.groups:  # on a shared cluster they would hold their CPUs and GPUs on
            with contextlib.suppress(Exception):
                remove_placement_group(group)
    ray.shutdown()  # also when ray.init was cut short
    print("ray_pd: stopped everything it started", flush=True)


def run(args: argparse.Namespace, deployment: Deployment) -> None:
    log_dir = args.log_dir or Path(tempfile.gettempdir()) / f"pd-ray-{os.getpid()}"
    connect_ray(args.address)
    launch_servers(args, log_dir, deployment)
    servers = wait_for_servers(deployment.starts, args.ready_timeout)
    ranks = get_by(list(deployment.ranks.values()), time.monotonic() + 10, "a rank's actor did not report")
    deployment.proxy = start_proxy(args, servers, log_dir)
    proxy_url = f"http://{args.host}:{args.port}"
    proxy = Launched(proxy_url, deployment.proxy, log_dir / "proxy.log")
    wait_ready(proxy, timeout_s=PROXY_READY_TIMEOUT_S, name="pd proxy")
    if args.urls_file is not None:
        write_urls(args.urls_file, proxy_url, servers, ranks)
    announce(args, proxy_url, servers, ranks, log_dir)
    keep_running(proxy, args.run_seconds, "pd proxy")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    deployment = Deployment()
    return run_deployment("ray_pd", args, lambda: run(args, deployment), lambda: teardown(deployment))


if __name__ == "__main__":
    sys.exit(main())
