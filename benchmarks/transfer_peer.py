"""What the transfer benchmarks share: a P peer in its own process (spawned, reporting
what D needs over a pipe), and the timers."""

from __future__ import annotations

import multiprocessing as mp
import time
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
