"""What the transfer benchmarks share: a P peer in its own process (spawned, reporting
what D needs over a pipe), the timers, and the CMA copy (`process_vm_readv`) NIXL is
measured against."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from connectors.nixl.transport import NixlTransport, TransferHandle

P_SEED, D_SEED = 11, 22
POLL_DEADLINE_S = 30.0


@dataclass
class Peer:
    process: mp.Process
    conn: object
    info: object  # what the peer sent once it was up (its port, ...)

    def stop(self) -> None:
        try:
            self.conn.send("stop")
        except OSError:
            pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def start_peer(target, *args) -> Peer:
    """Spawn `target(conn, *args)` as P; returns once it sent what D needs over `conn`."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=target, args=(child, *args), daemon=True)
    process.start()
    if not parent.poll(120):
        process.kill()
        process.join()
        raise RuntimeError(f"peer {args[0]} did not start")
    return Peer(process, parent, parent.recv())


def timed_read(d: NixlTransport, peer_id: str, local: list[list[int]], remote: list[list[int]],
               notif: bytes) -> tuple[float, TransferHandle]:
    started = time.perf_counter()
    handle = d.start_read(peer_id, local, remote, notif)
    while d.poll(handle) == "PROC":
        if time.perf_counter() - started > POLL_DEADLINE_S:
            raise RuntimeError(f"READ from {peer_id} still in progress after {POLL_DEADLINE_S} s")
    if handle.state != "DONE":
        raise RuntimeError(f"READ from {peer_id} failed: {handle.error}")
    return time.perf_counter() - started, handle


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


IOV_MAX = 1024  # iovecs per process_vm_readv call (Linux UIO_MAXIOV)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.process_vm_readv.restype = ctypes.c_ssize_t


def cma_read(pid: int, local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]]) -> int:
    """Copy (address, length) ranges of process `pid` into ours with process_vm_readv,
    IOV_MAX ranges per call; returns the bytes copied."""
    copied = 0
    for i in range(0, len(local), IOV_MAX):
        ours, theirs = local[i:i + IOV_MAX], remote[i:i + IOV_MAX]
        lv = (_IoVec * len(ours))(*[_IoVec(a, n) for a, n in ours])
        rv = (_IoVec * len(theirs))(*[_IoVec(a, n) for a, n in theirs])
        got = _LIBC.process_vm_readv(pid, lv, len(ours), rv, len(theirs), 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv: {os.strerror(err)}")
        copied += got
    return copied


def interleaved(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each of two functions, run in turns, each first in every other round."""
    times = {name: [] for name in fns}
    for i in range(repeats):
        for name, fn in list(fns.items())[::1 if i % 2 else -1]:
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return times


def sweep_row(block_bytes: int, count: int, num_bytes: int, times: dict[str, list[float]]) -> dict:
    """A sweep's figures for `count` blocks of `block_bytes` moving `num_bytes`: each
    way's median time and rate, and NIXL over CMA."""
    row = {"block_bytes": block_bytes, "blocks": count, "bytes": num_bytes, "ucx_tls": os.environ.get("UCX_TLS")}
    for name, values in times.items():
        if name.endswith("_share"):  # a ratio per round, not a time
            row[name] = statistics.median(values)
            continue
        row[f"{name}_gbps"] = num_bytes / statistics.median(values) / 1e9
        row[f"{name}_median_ms"] = statistics.median(values) * 1e3
    # each round's NIXL against the CMA copy next to it: the pairing cancels the machine's drift
    row["nixl_over_cma"] = statistics.median(c / n for n, c in zip(times["nixl"], times["cma"]))
    return row
