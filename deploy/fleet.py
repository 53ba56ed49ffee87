"""A fleet on Ray that follows its load: `pd proxy` with no fixed servers, and `pd planner
--launcher ray`, which starts the first servers as Ray actors, then switches their roles
and starts and stops servers by the SLO; every server joins the proxy by registering.

    python deploy/fleet.py --model DIR_OR_GGUF --ttft-slo 2 --tpot-slo 0.1 \\
        [--start-prefill 1 --start-decode 1] [--max-instances 6] [--address auto] [-- SERVE FLAGS]

Flags after `--` go to every `pd serve` the planner starts. The deployment's secret
(`$PD_KV_TRANSFER_SECRET`, made here when unset) signs the servers' registrations and
their KV parameters; the proxy's admin key (`$PD_PROXY_ADMIN_KEY`, made here when unset)
is written to `<log dir>/admin-key` (mode 600) for `curl` and `pd planner`. Ctrl-C,
SIGTERM or the end of `--run-seconds` stops the planner (which drains and stops every
server it started), then the proxy, then leaves Ray. How it works: deploy/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ray

from launch import Launched, LaunchError, exited, http_client, log_tail, pd_command
from launch.flags import parse_with_serve_args, port_number, positive_float, positive_int
from launch.process import STOP_TIMEOUT_S, start_logged, stop_process, wait_ready
from launch.ray_actors import connect_ray, run_deployment
from launch.signals import ignore_stop_signals
from wire.fleet import ADMIN_KEY_ENV, ADMIN_PATH, SECRET_ENV

PROXY_READY_TIMEOUT_S = 60.0
PLANNER_STOP_TIMEOUT_S = 2 * STOP_TIMEOUT_S + 30  # it drains and stops its servers first


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleet.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="A proxy and a planner that starts, re-roles and stops `pd serve` servers as Ray actors.",
        epilog="Flags after `--` go to every `pd serve`, e.g. `-- --num-threads 1 --max-model-len 2048`.")
    add = parser.add_argument
    add("--model", type=Path, required=True, metavar="DIR_OR_GGUF",
        help="HF-format model directory or .gguf file; the same path on every Ray node")
    add("--ttft-slo", type=positive_float, required=True, metavar="S", help="the TTFT the planner plans for, s")
    add("--tpot-slo", type=positive_float, required=True, metavar="S", help="the TPOT the planner plans for, s")
    add("--start-prefill", type=positive_int, default=1, metavar="N", help="prefill servers at the start (default 1)")
    add("--start-decode", type=positive_int, default=1, metavar="N", help="decode servers at the start (default 1)")
    add("--min-instances", type=positive_int, default=2, metavar="N",
        help="the fewest servers the planner keeps (default 2)")
    add("--max-instances", type=positive_int, default=None, metavar="N",
        help="the most servers the planner starts (default: the start's count: it only switches roles)")
    add("--cpus-per-server", type=positive_float, default=1.0, metavar="N",
        help="Ray CPUs each server reserves per tensor-parallel rank (default 1)")
    add("--tensor-parallel-size", type=positive_int, default=1, metavar="N",
        help="tensor-parallel ranks of each server (default 1)")
    add("--address", default=None, metavar="ADDR",
        help="Ray cluster to join, e.g. auto or HOST:6379 (default: start a local one)")
    add("--host", default="127.0.0.1", help="address the proxy listens on (default 127.0.0.1)")
    add("--port", type=port_number, default=8000, metavar="N", help="TCP port of the proxy (default 8000)")
    add("--fleet-allow", default=None, metavar="NETS",
        help="addresses servers may register from, comma-separated networks (the proxy's --fleet-allow; "
             "default: loopback only, as on a local cluster)")
    add("--planner-args", default="", metavar="FLAGS",
        help="more `pd planner` flags, one string (e.g. '--interval 1 --patience 3')")
    add("--ready-timeout", type=positive_float, default=180.0, metavar="S",
        help="seconds the first servers may take to join the proxy (default 180)")
    add("--run-seconds", type=positive_float, default=None, metavar="S",
        help="stop everything after this many seconds (default: run until Ctrl-C / SIGTERM)")
    add("--urls-file", type=Path, default=None, metavar="F",
        help="write the proxy's URL and the first servers' as JSON once they have joined")
    add("--log-dir", type=Path, default=None, metavar="D",
        help="directory for the logs (default: $TMPDIR/pd-fleet-<this pid>)")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    return parse_with_serve_args(build_parser(), argv)


@dataclass
class Fleet:
    """What this script started, for the teardown."""

    proxy: subprocess.Popen | None = None
    planner: subprocess.Popen | None = None


def environment(log_dir: Path) -> dict[str, str]:
    """The proxy's and the planner's environment: the deployment's secret and the admin
    key (made when unset; the key also written to `log_dir/admin-key`, mode 600)."""
    env = dict(os.environ)
    env.setdefault(SECRET_ENV, secrets.token_hex(32))
    env.setdefault(ADMIN_KEY_ENV, secrets.token_urlsafe(24))
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    log_dir.mkdir(parents=True, exist_ok=True)
    key_file = log_dir / "admin-key"
    key_file.touch(mode=0o600)
    key_file.write_text(env[ADMIN_KEY_ENV] + "\n")
    return env


def start_proxy(args: argparse.Namespace, log_dir: Path, env: dict[str, str]) -> subprocess.Popen:
    allow = ["--fleet-allow", args.fleet_allow] if args.fleet_allow else []
    cmd = pd_command("proxy", "--host", args.host, "--port", str(args.port), *allow)
    return start_logged(cmd, log_dir / "proxy.log", env, die_with_parent=True)


def planner_command(args: argparse.Namespace, proxy_url: str, ray_address: str, log_dir: Path) -> list[str]:
    scaling = [] if args.max_instances is None else ["--min-instances", str(args.min_instances), "--max-instances",
                                                     str(args.max_instances)]
    return pd_command("planner", "--proxy", proxy_url, "--ttft-slo", str(args.ttft_slo), "--tpot-slo",
                      str(args.tpot_slo), "--launcher", "ray", "--ray-address", ray_address, "--model",
                      str(args.model.resolve()), "--serve-args", shlex.join(args.serve_args), "--start-prefill",
                      str(args.start_prefill), "--start-decode", str(args.start_decode), "--cpus-per-server",
                      str(args.cpus_per_server), "--tensor-parallel-size", str(args.tensor_parallel_size),
                      "--log-dir", str(log_dir / "servers"), *scaling, *shlex.split(args.planner_args))


def wait_joined(proxy_url: str, n: int, admin_key: str, planner: Launched, timeout: float) -> list[dict]:
    """The proxy's instances once `n` have joined; raises if the planner exits first or
    they have not within `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        if exited(planner.process):
            raise RuntimeError(f"pd planner exited with {stop_process(planner.process)}; log {planner.log_path}:\n"
                               f"{log_tail(planner.log_path)}")
        listed = http_client().get(proxy_url + ADMIN_PATH, headers={"Authorization": f"Bearer {admin_key}"},
                                   timeout=5).json()["instances"]
        if len(listed) >= n:
            return listed
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(listed)} of {n} servers joined the proxy within {timeout:g} s; see "
                               f"{planner.log_path.parent / 'servers'}")
        time.sleep(0.5)


def teardown(fleet: Fleet) -> None:
    ignore_stop_signals()
    print("fleet: stopping the planner (it drains and stops its servers), then the proxy", flush=True)
    if fleet.planner is not None:
        stop_process(fleet.planner, PLANNER_STOP_TIMEOUT_S)
    if fleet.proxy is not None:
        stop_process(fleet.proxy)
    ray.shutdown()
    print("fleet: stopped everything it started", flush=True)


def run(args: argparse.Namespace, fleet: Fleet) -> None:
    log_dir = args.log_dir or Path(tempfile.gettempdir()) / f"pd-fleet-{os.getpid()}"
    connect_ray(args.address)  # first: it sets what Ray's processes (the planner's too) must see in the environment
    env = environment(log_dir)
    ray_address = ray.get_runtime_context().gcs_address
    proxy_url = f"http://{args.host}:{args.port}"
    fleet.proxy = start_proxy(args, log_dir, env)
    wait_ready(Launched(proxy_url, fleet.proxy, log_dir / "proxy.log"), lambda status: status in (200, 503),
               timeout_s=PROXY_READY_TIMEOUT_S, name="pd proxy")
    fleet.planner = start_logged(planner_command(args, proxy_url, ray_address, log_dir), log_dir / "planner.log",
                                 env, die_with_parent=True)
    planner = Launched(proxy_url, fleet.planner, log_dir / "planner.log")
    servers = wait_joined(proxy_url, args.start_prefill + args.start_decode, env[ADMIN_KEY_ENV], planner,
                          args.ready_timeout)
    if args.urls_file is not None:
        partial = args.urls_file.with_name(f"{args.urls_file.name}.partial")
        partial.write_text(json.dumps({"proxy": proxy_url, "ray": ray_address, "log_dir": str(log_dir),
                                       "servers": [{"url": s["url"], "role": s["role"]} for s in servers]}, indent=2))
        partial.replace(args.urls_file)
    print(f"fleet: {proxy_url} in front of {len(servers)} servers on Ray ({args.address or 'local cluster'}); "
          f"planner log {log_dir / 'planner.log'}, admin key in {log_dir / 'admin-key'}")
    for s in servers:
        print(f"  {s['role'] + ':':8} {s['url']}")
    until = f"for {args.run_seconds:g} s" if args.run_seconds else "until Ctrl-C / SIGTERM"
    print(f"fleet: serving {until}", flush=True)
    deadline = time.monotonic() + args.run_seconds if args.run_seconds else float("inf")
    proxy = Launched(proxy_url, fleet.proxy, log_dir / "proxy.log")
    while time.monotonic() < deadline:  # until then, neither may exit
        for launched, name in ((proxy, "pd proxy"), (planner, "pd planner")):
            if exited(launched.process):
                raise LaunchError(f"{name} exited with {stop_process(launched.process)}; log {launched.log_path}:\n"
                                  f"{launched.log_tail()}")
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    fleet = Fleet()
    return run_deployment("fleet", args, lambda: run(args, fleet), lambda: teardown(fleet))


if __name__ == "__main__":
    sys.exit(main())
