"""The servers the planner starts and stops (`pd planner --launcher local|ray`).

A launcher starts `pd serve --model M --role both --kv-connector nixl --register PROXY
--register-role ROLE` (and the deployment's `--serve-args`): the server joins the proxy's
fleet by itself once it is ready, and the planner finds it in the proxy's list. Until
then it is *starting*: the planner counts it (so that it does not ask for a second one),
never moves it, and stops no server while it starts (`with_launched`).

Stopping one (`stop`): the planner has drained it through the proxy's admin API first, so
no new request reaches it; the launcher then sends SIGTERM. The server hands the
proxy's streams on to other decode servers with their KV, finishes what else it holds
(pd/server/drain.py, bounded by its `--drain-timeout`), tells the proxy it is leaving
and exits; SIGKILL past `launch.process.STOP_TIMEOUT_S`. Stops run on threads of
their own: a drain never holds up a tick. `close` stops every server the launcher
started, all at once, and waits for them.

- `LocalLauncher`: processes of this machine.
- `RayLauncher`: one `PDServer` actor per server (launch/ray_actors.py) in a placement
  group of its own (`--cpus-per-server` CPUs per tensor-parallel rank, one GPU per rank
  where the cluster has GPUs), placed by Ray on any node; the actors are this process's,
  so they end with it.

Both need the deployment's secret in `$PD_KV_TRANSFER_SECRET`: the servers sign their
registrations with it (the proxy's `--fleet-secret`) and P and D their KV parameters.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from launch.ports import free_port
from launch.process import exited, log_tail, pd_command, start_logged, stop_process
from planner.policy import Member
from wire.fleet import SECRET_ENV

logger = logging.getLogger("pd.planner")
PLACEMENT_TIMEOUT_S = 60.0  # a Ray server not placed by then is given up (no free CPUs / GPUs)
ANSWER_S = 10.0  # for the actors to say whether their servers still run


class LauncherError(RuntimeError):
    """A server could not be started."""


@dataclass
class Started:
    url: str
    role: str  # the role it registers for
    handle: Any  # LocalLauncher: its Popen; RayLauncher: (actor, placement group)
    log: str


class Launcher:
    """What both launchers share: the servers started, their flags, the stop threads."""

    def __init__(self, proxy: str, model: str, serve_args: list[str], log_dir: Path) -> None:
        self.secret = os.environ.get(SECRET_ENV)
        if not self.secret:
            raise LauncherError(f"${SECRET_ENV} must hold the deployment's secret (the proxy's --fleet-secret): "
                                "the servers sign their registrations with it")
        self.proxy, self.model, self.serve_args, self.log_dir = proxy, model, serve_args, log_dir
        self.started: dict[str, Started] = {}
        self._stopping: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()
        self._count = 0

    def server_flags(self, role: str) -> list[str]:
        """`pd serve`'s flags past its model, address and `--role both`."""
        return ["--kv-connector", "nixl", "--register", self.proxy, "--register-role", role, *self.serve_args]

    def start(self, role: str) -> Started:
        """Start a server that registers for `role`; LauncherError if it cannot be."""
        self._count += 1
        started = self._start(role, self._count)
        with self._lock:
            self.started[started.url] = started
        logger.info("started %s for %s (log %s)", started.url, role, started.log)
        return started

    def stop(self, url: str) -> None:
        """SIGTERM the server at `url` (drained by the caller first), on a thread."""
        with self._lock:
            started = self.started.get(url)
            if started is None or url in self._stopping:
                return
            thread = self._stopping[url] = threading.Thread(target=self._stop_and_forget, args=(started,),
                                                            name=f"stop {url}", daemon=True)
        thread.start()

    def stoppable(self) -> set[str]:
        with self._lock:
            return set(self.started) - set(self._stopping)

    def starting(self, listed: set[str]) -> list[Started]:
        """Those started that are not in `listed` (the proxy's fleet) yet, nor stopping."""
        with self._lock:
            return [s for url, s in self.started.items() if url not in listed and url not in self._stopping]

    def reap(self) -> list[str]:
        """Forget the servers that exited on their own; a line on each, with its log's tail."""
        with self._lock:
            running = [s for url, s in self.started.items() if url not in self._stopping]
        gone = self._exited(running)  # outside the lock: on Ray, a round trip to each actor
        with self._lock:
            for s in gone:
                if s.url not in self._stopping:
                    self.started.pop(s.url, None)
        return [f"{s.url} ({s.role}) exited by itself; log {s.log}:\n{log_tail(Path(s.log), 2000)}" for s in gone]

    def close(self) -> None:
        """Stop every server started (at once), and wait for them."""
        for url in list(self.started):
            self.stop(url)
        for thread in list(self._stopping.values()):
            thread.join()

    def _stop_and_forget(self, started: Started) -> None:
        try:
            self._stop(started)
            logger.info("stopped %s", started.url)
        except Exception as exc:  # a stop that fails is logged; the launcher goes on
            logger.warning("stopping %s failed: %s: %s", started.url, type(exc).__name__, exc)
        finally:
            with self._lock:
                self.started.pop(started.url, None)
                self._stopping.pop(started.url, None)

    def _start(self, role: str, index: int) -> Started:
        raise NotImplementedError

    def _stop(self, started: Started) -> None:
        raise NotImplementedError

    def _exited(self, servers: list[Started]) -> list[Started]:
        """Those of `servers` whose process has exited."""
        raise NotImplementedError


class LocalLauncher(Launcher):
    def __init__(self, proxy: str, model: str, serve_args: list[str], log_dir: Path, host: str = "127.0.0.1") -> None:
        super().__init__(proxy, model, serve_args, log_dir)
        self.host = host

    def _start(self, role: str, index: int) -> Started:
        port = free_port(self.host)
        url, log = f"http://{self.host}:{port}", self.log_dir / f"server-{index}-{role}.log"
        cmd = pd_command("serve", "--model", self.model, "--host", self.host, "--port", str(port), "--role", "both",
                         *self.server_flags(role))
        try:
            process = start_logged(cmd, log, dict(os.environ), die_with_parent=True)
        except OSError as exc:
            raise LauncherError(f"cannot start a server: {exc}") from exc
        return Started(url, role, process, str(log))

    def _stop(self, started: Started) -> None:
        stop_process(started.handle)

    def _exited(self, servers: list[Started]) -> list[Started]:
        return [s for s in servers if exited(s.handle)]


class RayLauncher(Launcher):
    def __init__(self, proxy: str, model: str, serve_args: list[str], log_dir: Path, address: str | None,
                 cpus_per_server: float, tensor_parallel_size: int = 1) -> None:
        super().__init__(proxy, model, serve_args, log_dir)
        import ray

        from launch.ray_actors import connect_ray

        try:
            connect_ray(address)
        except (ConnectionError, RuntimeError, ValueError, OSError) as exc:
            raise LauncherError(f"cannot join the Ray cluster {address or '(a local one)'}: {exc}") from exc
        self.ray = ray
        bundle = {"CPU": cpus_per_server * tensor_parallel_size}
        if ray.cluster_resources().get("GPU", 0) > 0:
            bundle["GPU"] = float(tensor_parallel_size)
        self.bundle, self.tensor_parallel_size = bundle, tensor_parallel_size

    def _start(self, role: str, index: int) -> Started:
        from ray.util.placement_group import placement_group, remove_placement_group

        from launch.ray_actors import PDServer, describe, placed

        group = placement_group([self.bundle], strategy="STRICT_PACK")
        actor = placed(PDServer, group, 0, self.bundle).remote(
            "both", index, self.model, [*self.server_flags(role), "--tensor-parallel-size",
                                        str(self.tensor_parallel_size)], str(self.log_dir), self.secret)
        try:
            info = self.ray.get(actor.start.remote(), timeout=PLACEMENT_TIMEOUT_S)
        except (self.ray.exceptions.RayError, TimeoutError) as exc:
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)
            with contextlib.suppress(Exception):
                remove_placement_group(group)
            raise LauncherError(f"Ray could not start a server within {PLACEMENT_TIMEOUT_S:g} s (free CPUs "
                                f"{self.ray.available_resources().get('CPU', 0):g}, it needs {self.bundle}): "
                                f"{describe(exc)}") from exc
        return Started(info["url"], role, (actor, group), info["log"])

    def _stop(self, started: Started) -> None:
        from ray.util.placement_group import remove_placement_group

        actor, group = started.handle
        try:
            self.ray.get(actor.stop.remote())
        finally:
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)
            with contextlib.suppress(Exception):
                remove_placement_group(group)

    def _exited(self, servers: list[Started]) -> list[Started]:
        """Asked of every actor at once (`PDServer.ready` raises once its server exited; an
        actor that does not answer within ANSWER_S is busy, not gone)."""
        asked = {s.handle[0].ready.remote(): s for s in servers}
        answered, _ = self.ray.wait(list(asked), num_returns=len(asked), timeout=ANSWER_S) if asked else ([], [])
        gone = []
        for ref in answered:
            try:
                self.ray.get(ref)
            except (self.ray.exceptions.RayError, RuntimeError):
                gone.append(asked[ref])
        return gone

    def close(self) -> None:
        super().close()
        self.ray.shutdown()


def with_launched(members: list[Member], launcher: Launcher | None) -> list[Member]:
    """The proxy's members, those the launcher started marked stoppable, and those it
    started that have not joined yet added as starting (counted, never moved)."""
    if launcher is None:
        return members
    stoppable = launcher.stoppable()
    starting = launcher.starting({m.url for m in members})
    return [replace(m, stoppable=m.url in stoppable) for m in members] + [
        Member(s.url, s.role, (s.role,), starting=True) for s in starting]
