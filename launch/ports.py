"""Free ports for servers this machine's launchers start, each handed out once.

A port is picked free, then passed on a command line; the server binds it seconds later,
after its weights load. Two things could take it meanwhile, and neither may:

- the kernel: a bind to port 0 (a library's listener, another launcher's pick) or an
  outgoing connection takes a port of the kernel's ephemeral range
  (/proc/sys/net/ipv4/ip_local_port_range) — so ports are picked below that range, from
  `LOWEST` up (below it: Ray's worker ports and well-known services), where nothing is
  handed out by the kernel; only where that range leaves too few ports is the kernel
  asked for one;
- another launcher's pick, on this machine (tests run in several workers) or in this
  process (a deployment's HTTP and KV events ports were once the same) — so each port
  handed out is reserved, machine-wide, by a file created exclusively in a directory of
  this user's. A reservation older than `RESERVATION_S` is stale (its server has bound
  the port or never will) and is taken over.

Where no port must be known in advance there is no race at all: `pd serve` and `pd proxy`
take `--port 0` (the kernel picks as they bind) and `--port-file PATH` (they write the
port bound there at once, `write_port`), and the launcher reads it (`read_port`) before
it waits for /health. The tests' servers start so.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import socket
import tempfile
import time
from pathlib import Path

RESERVATION_S = 600.0
TRIES = 200
LOWEST = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
MIN_CANDIDATES = 4096  # fewer ports below the ephemeral range than this: ask the kernel


def reservations_dir() -> Path:
    path = Path(tempfile.gettempdir()) / f"pd-port-reservations-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


@functools.cache
def sweep(directory: Path) -> None:
    """Remove the stale reservations, once per process: the directory holds at most the
    ports handed out within the last `RESERVATION_S` seconds (and whatever this process
    reserves)."""
    now = time.time()
    for path in directory.iterdir():
        with contextlib.suppress(FileNotFoundError):  # another launcher swept it first
            if now - path.stat().st_mtime >= RESERVATION_S:
                path.unlink()


@functools.cache
def candidates() -> range | None:
    """The ports picked from: those from `LOWEST` up to the kernel's ephemeral range; None
    where they are too few (or the range cannot be read)."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return range(LOWEST, low) if low - LOWEST >= MIN_CANDIDATES else None


def pick_port(host: str) -> int | None:
    """A port free on `host` now, or None if the one tried is not."""
    ports = candidates()
    with socket.socket() as s:
        try:
            s.bind((host, 0 if ports is None else ports[secrets.randbelow(len(ports))]))
        except OSError:
            return None  # in use (or in TIME_WAIT: a server might bind it, this check does not)
        return s.getsockname()[1]


def reserve(port: int, directory: Path, now: float) -> bool:
    """Whether `port` is now reserved for this caller: no one holds it, or only stale."""
    path = directory / str(port)
    for _ in range(2):
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return True
        except FileExistsError:
            try:
                if now - path.stat().st_mtime < RESERVATION_S:
                    return False
                path.unlink()
            except FileNotFoundError:
                pass  # another launcher took the stale reservation over first: try once more
    return False


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` that no launcher on this machine was handed within the last
    `RESERVATION_S` seconds."""
    directory = reservations_dir()
    sweep(directory)
    for _ in range(TRIES):
        port = pick_port(host)
        if port is not None and reserve(port, directory, time.time()):
            return port
    raise OSError(f"no free port on {host} in {TRIES} tries: every one tried was in use or handed out "
                  f"within {RESERVATION_S:g} s (reservations in {directory})")


def write_port(path: str | Path, port: int) -> None:
    """Write the port a server listens on to `path` (`--port-file`), whole or not at all."""
    path = Path(path)
    part = path.with_name(f".{path.name}.{os.getpid()}")
    part.write_text(f"{port}\n")
    os.replace(part, path)


def read_port(path: str | Path) -> int | None:
    """The port written to `path` by `write_port`; None until it is there."""
    try:
        return int(Path(path).read_text())
    except (FileNotFoundError, ValueError):
        return None


def listen(host: str, port: int, port_file: str | Path | None = None, backlog: int = 2048) -> socket.socket:
    """A TCP socket listening on host:port (port 0: any free one, as the kernel picks it),
    its port written to `port_file` at once if one is given; OSError if it cannot."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    listener = socket.create_server((host, port), family=family, backlog=backlog)
    if port_file is not None:
        try:
            write_port(port_file, listener.getsockname()[1])
        except OSError:
            listener.close()
            raise
    return listener
