"""Free ports for servers this machine's launchers start, each handed out once.

A port is picked free by binding port 0, then closed and passed on a command line; the
server binds it seconds later, after its weights load. Meanwhile the kernel can pick the
same port again, for this process (a deployment's HTTP port and its KV events port were
once the same) or another launcher on the machine (tests run in several workers). So each
port handed out is reserved, machine-wide, by a file created exclusively in a directory of
this user's; the kernel skips ports in use, the reservation those picked and not yet
bound. A reservation older than `RESERVATION_S` is stale (its server has bound the port
or never will) and is taken over.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import tempfile
import time
from pathlib import Path

RESERVATION_S = 600.0
TRIES = 200


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


def kernel_port(host: str) -> int:
    """A port free on `host` now, as the kernel picks it."""
    with socket.socket() as s:
        s.bind((host, 0))
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
        port = kernel_port(host)
        if reserve(port, directory, time.time()):
            return port
    raise OSError(f"no free port on {host} in {TRIES} tries: every one the kernel picked was handed out "
                  f"within {RESERVATION_S:g} s (reservations in {directory})")
