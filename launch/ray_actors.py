"""`pd serve` servers as Ray actors: one `PDServer` actor per server, placed by Ray, starts
the server on a free port of its node and stops it by PID; a `PDRank` actor runs one
tensor-parallel rank of a server on another node. Used by deploy/ray_pd.py (a fixed
xPyD) and by `pd planner --launcher ray` (planner/launchers.py, a fleet that grows and
shrinks). Needs Ray, unlike the rest of `launch`: import it only where Ray is used.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray._private import ray_constants
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from launch.ports import free_port
from launch.process import exited, health_status, log_tail, pd_command, start_logged, stop_process
from launch.signals import install_signal_handlers, signals_deferred
from wire.fleet import SECRET_ENV

LOCAL_OBJECT_STORE_BYTES = 200 * 1024**2
RAY_NO_CLUSTER_NETWORKING = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's nodes on 127.0.0.1


class PDServer:
    """One `pd serve` subprocess on the node Ray placed this actor on.

    No method blocks for long, so `stop` is served promptly even while the server starts.
    """

    def __init__(self, role: str, index: int, model: str, serve_args: list[str], log_dir: str,
                 transfer_secret: str, remote_ranks: bool = False) -> None:
        self.role, self.index, self.model = role, index, model
        self.serve_args, self.log_dir = serve_args, Path(log_dir)
        self.remote_ranks = remote_ranks  # its ranks past 0 join from actors of their own (`--tp-span-nodes`)
        self.transfer_secret = transfer_secret  # the deployment's: P signs kv_transfer_params, D checks them
        self.process: subprocess.Popen | None = None
        self.url, self.log_path = "", self.log_dir / f"{role}-{index}.log"
        atexit.register(self.stop)

    def start(self) -> dict[str, Any]:
        """Start the server on a free port of this node; its role, URL, node, port, PID and
        log (and where its other ranks join, with remote ranks)."""
        host = ray.util.get_node_ip_address()
        port = free_port(host)
        self.url = f"http://{host}:{port}"
        join = []
        if self.remote_ranks:  # rank 0 only here; the others join at this node's address
            join = ["--tp-local-ranks", "1", "--tp-host", host, "--tp-port", str(free_port(host))]
        cmd = pd_command("serve", "--model", self.model, "--role", self.role, "--host", host, "--port", str(port),
                         "--kv-host", host, *join, *self.serve_args)
        self.process = start_logged(cmd, self.log_path, secret_env(self.transfer_secret), die_with_parent=True)
        return {"role": self.role, "url": self.url, "node_ip": host, "port": port, "pid": self.process.pid,
                "log": str(self.log_path), "node_id": ray.get_runtime_context().get_node_id(),
                "tp_join": f"{host}:{join[-1]}" if join else None}

    def ready(self) -> bool:
        """Whether /health answers 200; raises, with the log's tail, if the server exited."""
        if self.process is not None and exited(self.process):
            code = self.stop()
            raise RuntimeError(f"{self.role} server {self.index} ({self.url}) exited with {code}; "
                               f"log {self.log_path}:\n{log_tail(self.log_path)}")
        return health_status(self.url) == 200

    def stop(self) -> int | None:
        """Stop the server (SIGTERM, SIGKILL after 20 s); its exit code, None if never started."""
        if self.process is None:
            return None
        return stop_process(self.process)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()


class PDRank:
    """One tensor-parallel rank (`pd tp-rank`) of a server, on the node Ray placed this
    actor on: it joins the server at the address the server's actor reported."""

    def __init__(self, rank: int, log_dir: str, transfer_secret: str) -> None:
        self.rank, self.log_dir, self.transfer_secret = rank, Path(log_dir), transfer_secret
        self.process: subprocess.Popen | None = None
        atexit.register(self.stop)

    def start(self, server: dict[str, Any]) -> dict[str, Any]:
        """Join `server` (its actor's `start` result); where this rank runs."""
        log_path = self.log_dir / f"{server['role']}-{server['port']}-rank{self.rank}.log"
        cmd = pd_command("tp-rank", "--join", server["tp_join"], "--rank", str(self.rank))
        self.process = start_logged(cmd, log_path, secret_env(self.transfer_secret), die_with_parent=True)
        return {"server": server["url"], "rank": self.rank, "node_ip": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(), "pid": self.process.pid, "log": str(log_path)}

    def stop(self) -> int | None:
        return None if self.process is None else stop_process(self.process)


def secret_env(secret: str) -> dict[str, str]:
    """The servers' and ranks' environment: the deployment's secret in it (not in `ps`)."""
    env = dict(os.environ) | {SECRET_ENV: secret}
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    return env


def connect_ray(address: str | None) -> None:
    with signals_deferred():
        if address is not None:
            ray.init(address=address)
        else:
            # "local": a new cluster, even where `ray start` left one (or its address file) behind;
            # on loopback, so that its servers bind 127.0.0.1 as `pd serve` does: Ray gives a node
            # the machine's outward address unless told it has no cluster networking, which Ray
            # reads once, at import (ray.init's _node_ip_address did not change what the
            # workers saw). Its processes, started by ray.init, inherit the variable.
            os.environ.setdefault(RAY_NO_CLUSTER_NETWORKING, "0")
            if os.environ[RAY_NO_CLUSTER_NETWORKING] == "0":
                ray_constants.ENABLE_RAY_CLUSTER = False
            ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False,
                     object_store_memory=LOCAL_OBJECT_STORE_BYTES)


def placed(cls: type, group: Any, bundle_index: int, bundle: dict[str, float]) -> Any:
    """`cls` as a Ray actor in bundle `bundle_index` of `group`, reserving all of it."""
    return ray.remote(cls).options(
        num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle_index))


def get_by(refs: list[ray.ObjectRef], deadline: float, late: str) -> list[Any]:
    """ray.get(refs), waiting in 1 s steps (so signals are handled) until `deadline`;
    RuntimeError(late) then. An actor's error is raised as soon as all results are in."""
    pending = refs
    while pending:
        if time.monotonic() > deadline:
            raise RuntimeError(late)
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
    return ray.get(refs)


def describe(error: BaseException) -> str:
    """An actor's own error rather than Ray's wrapping of it (with the remote traceback)."""
    if isinstance(error, ray.exceptions.RayTaskError) and error.cause is not None:
        return str(error.cause)
    return str(error)


def run_deployment(name: str, args: Any, run: Callable[[], None], teardown: Callable[[], None]) -> int:
    """A Ray deployment script's main: its model checked (on this machine, when it starts
    its own cluster), SIGTERM / SIGHUP unwinding through `teardown`, an error reported
    on one line; the exit code."""
    model = args.model
    if args.address is None and not ((model / "config.json").is_file() or model.suffix == ".gguf"
                                     and model.is_file()):
        print(f"{name}: no model at {model} (neither config.json nor a .gguf file)", file=sys.stderr)
        return 2
    install_signal_handlers()
    try:
        run()
    except (KeyboardInterrupt, SystemExit):
        pass
    # LaunchError is a RuntimeError: report it, then tear down
    except (RuntimeError, OSError, ValueError, ray.exceptions.RayError) as e:
        print(f"{name}: {describe(e)}", file=sys.stderr)
        return 1
    finally:
        teardown()
    return 0
