"""The processes a launcher leaves behind, read from /proc: whether any of ours still
runs, serves a port or accepts connections, for the tests of the deploy scripts."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx

EXIT_TIMEOUT_S = 120.0


def read_proc(pid: int, name: str) -> str:
    return Path(f"/proc/{pid}/{name}").read_bytes().decode(errors="replace")


def pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def alive(pid: int) -> bool:
    """Running, and not a zombie (this container's init may be slow to reap orphans)."""
    try:
        return read_proc(pid, "stat").rpartition(") ")[2][0] != "Z"
    except OSError:
        return False


def parent(pid: int) -> int | None:
    try:
        return int(read_proc(pid, "stat").rpartition(") ")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid in pids():
        children.setdefault(parent(pid), []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def argv(pid: int) -> list[str]:
    try:
        return read_proc(pid, "cmdline").split("\0")
    except OSError:
        return []


def serving_port(pid: int, port: int) -> bool:
    """Whether `pid`'s command line has `--port PORT` (a `pd serve` of ours)."""
    args = argv(pid)
    return any(a == "--port" and b == str(port) for a, b in itertools.pairwise(args))


def accepts(url: str) -> bool:
    host, port = httpx.URL(url).host, httpx.URL(url).port
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) == 0


def wait_until_gone(pids_: set[int], timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    while (left := {p for p in pids_ if alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def stop(process: subprocess.Popen) -> None:
    """SIGTERM first (its teardown stops the servers), SIGKILL only if that hangs."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
