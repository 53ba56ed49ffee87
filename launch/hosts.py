"""Separate network hosts on this machine, for the tests and benchmarks of what crosses a
network (tests/multihost/, benchmarks/transfer_hosts.py): Linux network namespaces joined
by a bridge, each with its own stack, address, routes and ports, and links that can be
cut, cut one way, or capped. Needs root (`unavailable` says why not).

`Network(n)` makes n hosts, `pdh<pid>n<k>x<i>`, addressed 198.18.0.<i + 1>/24 (198.18.0.0/15
is reserved for network benchmarks). The bridge lives in a namespace of its own (`…sw`),
each host joined to it by a veth pair; nothing is made or changed in the machine's own
namespace, and no host can reach any network but the bridge. `close` (or leaving the
`with`) stops the processes started in the hosts and deletes every namespace, which
takes their links with them; namespaces left by a run that died are deleted by the next
(`sweep`: their names carry the PID of a process that no longer exists).

- `popen(host, argv)`: a process inside a host (`ip netns exec`), with this process's
  environment less this machine's UCX choices (MACHINE_ENV).
- `start(host, name, *args)`: `pd NAME` inside a host, listening on its address (port
  8000: every host has ports of its own), once ready; stopped when the network closes.
- `call(host, fn, ...)`: `fn` run by a thread of this process that has entered the host's
  network namespace (`setns`, per thread; calls from different threads run side by side,
  CALLS_AT_ONCE per host): what it connects to, it connects to from that host. Every
  connection to a host's address must be made that way: the test's own threads stay in
  the machine's namespace, where such an address is routed out to the machine's network
  (never send anything there). A pooled connection made in a host may be reused from any
  thread, so requests to hosts go through `call` alone.
- `cut(a, b=None, one_way=False)`: a partition. Between two hosts, by a neighbour entry
  that sends a's frames for b to an address no port has (the bridge floods them, nobody
  takes them: dropped silently, as on a wire), and b's for a likewise unless `one_way`.
  With no `b`, a's link to the bridge drops every frame both ways (`one_way`: only what a
  sends), by a queue that holds none (`pfifo limit 0`). `restore` undoes it.
- `cap(host, mbit)`: a's link shaped to `mbit` Mbit/s each way (`tbf`); `uncap`.

`unavailable()` says why hosts cannot be made here (not root, no `ip`, namespaces not
permitted), or None; tests skip saying so.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import itertools
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from launch.process import Launched, pd_command, start, stop_process, terminate_all, wait_started

PREFIX = "pdh"
SUBNET = ipaddress.ip_network("198.18.0.0/24")  # within 198.18.0.0/15
NOWHERE_MAC = "02:00:00:00:00:01"  # locally administered; no port of the bridge has it
STOP_S = 10.0
# This machine's own UCX choices (a process that made NIXL agents for loopback peers set
# them: shared memory, `lo`): a host is another machine, whose servers choose their own.
MACHINE_ENV = ("UCX_TLS", "UCX_NET_DEVICES")
PORT = 8000  # what servers listen on in a host
CALLS_AT_ONCE = 4  # `call`s from different threads into one host run side by side (a stream and a probe)
_networks = itertools.count()  # of this process: each network's namespaces have names of their own
CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def _ip(*args: str, namespace: str | None = None) -> str:
    command = ["ip", *(("-n", namespace) if namespace else ()), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise HostError(f"{' '.join(command)}: {done.stderr.strip()}")
    return done.stdout


def _tc(namespace: str, *args: str) -> None:
    command = ["tc", "-n", namespace, *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise HostError(f"{' '.join(command)}: {done.stderr.strip()}")


class HostError(RuntimeError):
    """A namespace, link or queue could not be made or changed."""


def unavailable() -> str | None:
    """Why hosts cannot be made on this machine; None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}probe"
    try:
        _ip("netns", "add", probe)
    except HostError as e:
        return f"network namespaces are not permitted here: {e}"
    _ip("netns", "del", probe)
    return None


def sweep() -> list[str]:
    """Delete the namespaces of runs whose process is gone; their names."""
    swept = []
    for line in _ip("netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX):
            continue
        pid = re.match(r"\d*", name[len(PREFIX):]).group()
        if pid and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(HostError):
                _ip("netns", "del", name)
                swept.append(name)
    return swept


@dataclass
class Host:
    """One host: its namespace, its address, its end of the link and the bridge's."""

    name: str
    address: str
    device: str  # in the host's namespace
    port: str  # the bridge's end, in the switch's namespace


@dataclass
class Network:
    size: int
    hosts: list[Host] = field(default_factory=list)
    switch: str = ""
    processes: list[subprocess.Popen] = field(default_factory=list)
    threads: dict[str, ThreadPoolExecutor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sweep()
        tag = f"{PREFIX}{os.getpid()}n{next(_networks)}"
        self.switch = f"{tag}sw"
        try:
            self._build(tag)
        except BaseException:
            self.close()
            raise

    def _build(self, tag: str) -> None:
        _ip("netns", "add", self.switch)
        _ip("link", "add", "br0", "type", "bridge", namespace=self.switch)
        _ip("link", "set", "br0", "up", namespace=self.switch)
        addresses = list(SUBNET.hosts())
        for i in range(self.size):
            host = Host(f"{tag}x{i}", str(addresses[i]), f"eth{i}", f"p{i}")
            _ip("netns", "add", host.name)
            self.hosts.append(host)
            _ip("link", "add", host.device, "netns", host.name, "type", "veth", "peer", "name", host.port,
                "netns", self.switch, namespace=self.switch)
            _ip("link", "set", host.port, "master", "br0", "up", namespace=self.switch)
            _ip("addr", "add", f"{host.address}/{SUBNET.prefixlen}", "dev", host.device, namespace=host.name)
            _ip("link", "set", host.device, "up", namespace=host.name)
            _ip("link", "set", "lo", "up", namespace=host.name)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def popen(self, host: Host, argv: list[str], **kwargs) -> subprocess.Popen:
        """`argv` run inside `host`; stopped (by PID) when the network closes."""
        kwargs.setdefault("env", host_env())
        process = subprocess.Popen(["ip", "netns", "exec", host.name, *argv], **kwargs)
        self.processes.append(process)
        return process

    def start(self, host: Host, name: str, *args: str, log: Path, wait: bool = True) -> Launched:
        """`pd NAME *args` inside `host` on its address and PORT, logged to `log`; once it
        answers /health (200; a proxy's 503 with no healthy server too) unless not `wait`
        (then `ready`). Stopped, by PID, when the network closes."""
        argv = ["ip", "netns", "exec", host.name, *pd_command(name, "--host", host.address, "--port",
                                                                     str(PORT), *args)]
        ready = (lambda status: status == 200) if name == "serve" else (lambda status: status in (200, 503))
        launched = start(argv, f"http://{host.address}:{PORT}", log, ready=ready, wait=False, env=host_env(),
                         die_with_parent=True)  # not left serving in a deleted host if this process is killed
        self.processes.append(launched.process)
        if wait:
            self.ready(host, launched)
        return launched

    def ready(self, host: Host, *launched: Launched) -> None:
        """Wait, from inside `host`, until servers `start`ed with wait=False are ready."""
        self.call(host, wait_started, *launched)

    def call(self, host: Host, fn: Callable[..., T], *args, **kwargs) -> T:
        """`fn(*args, **kwargs)` from inside `host`: on a thread that entered its namespace
        (at once, when called from that thread: `fn` may call again)."""
        if threading.current_thread().name.startswith(f"in-{host.name}_"):
            return fn(*args, **kwargs)
        if host.name not in self.threads:
            self.threads[host.name] = ThreadPoolExecutor(CALLS_AT_ONCE, f"in-{host.name}", _enter, (host.name,))
        return self.threads[host.name].submit(fn, *args, **kwargs).result()

    def cut(self, a: Host, b: Host | None = None, one_way: bool = False) -> None:
        """Drop what `a` sends to `b` (and `b` to `a` unless `one_way`); with no `b`, what
        crosses `a`'s link (what it sends, with `one_way`)."""
        if b is not None:
            for src, dst in ((a, b),) if one_way else ((a, b), (b, a)):
                _ip("neigh", "replace", dst.address, "lladdr", NOWHERE_MAC, "nud", "permanent", "dev", src.device,
                    namespace=src.name)
            return
        _tc(a.name, "qdisc", "replace", "dev", a.device, "root", "pfifo", "limit", "0")
        if not one_way:
            _tc(self.switch, "qdisc", "replace", "dev", a.port, "root", "pfifo", "limit", "0")

    def restore(self, a: Host, b: Host | None = None) -> None:
        """Undo `cut(a, b)` (either way) and `cap(a)` alike: `a`'s link as it was made."""
        if b is not None:
            for src, dst in ((a, b), (b, a)):
                with contextlib.suppress(HostError):  # not cut that way: nothing to undo
                    _ip("neigh", "del", dst.address, "dev", src.device, namespace=src.name)
            return
        for namespace, device in ((a.name, a.device), (self.switch, a.port)):
            with contextlib.suppress(HostError):  # none there: nothing to undo
                _tc(namespace, "qdisc", "del", "dev", device, "root")

    def cap(self, host: Host, mbit: float) -> None:
        """Shape `host`'s link to `mbit` Mbit/s each way (a token bucket: bursts of 64 KiB)."""
        rate = f"{mbit}mbit"
        for namespace, device in ((host.name, host.device), (self.switch, host.port)):
            _tc(namespace, "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate, "burst", "64kb",
                "latency", "200ms")

    def uncap(self, host: Host) -> None:
        self.restore(host)

    def close(self) -> None:
        """Stop what was started in the hosts (SIGTERM to all, SIGKILL after STOP_S, their
        process groups ended), then delete
        every namespace; idempotent, and never raises for what is already gone."""
        terminate_all(self.processes)  # side by side
        for process in self.processes:
            stop_process(process, STOP_S)
        self.processes.clear()
        for threads in self.threads.values():
            threads.shutdown()
        self.threads.clear()
        for name in [h.name for h in self.hosts] + ([self.switch] if self.switch else []):
            with contextlib.suppress(HostError):
                _ip("netns", "del", name)
        self.hosts.clear()


def host_env() -> dict[str, str]:
    """The environment of a process started in a host: this process's, less MACHINE_ENV."""
    return {name: value for name, value in os.environ.items() if name not in MACHINE_ENV}


def _enter(name: str) -> None:
    """Move the calling thread into network namespace `name` (its sockets are made there)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns into {name}: {os.strerror(error)}")
    finally:
        os.close(fd)
