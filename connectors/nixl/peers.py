"""Side-channel handshakes with prefill servers, off the engine step.

A handshake is a network round trip that may take up to its timeout (a peer that
accepts TCP and never answers), so each runs on a thread of its own; the engine thread
only starts them and collects what finished, once per step. Handshakes never queue
behind one another: with `MAX_PENDING` under way (forged parameters naming 40 engine
ids that never answer once made a request behind them wait 49 s), or
`MAX_PENDING_PER_ADDRESS` with one host and port, another is refused at once instead.
One engine id gets one handshake at a time, however many requests wait for it. A peer
whose handshake failed is remembered for `backoff_s`: requests naming it meanwhile fail
at once instead of each trying again.

Only the side-channel exchange runs on the pool: loading the peer's NIXL agent (which
touches the engine's agent) is left to the caller, on the engine thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from connectors.nixl.handshake import fetch_remote_layout
from connectors.nixl.peer_messages import HandshakeRequest, HandshakeResponse

MAX_PENDING = 64  # handshakes under way at once (each on a thread of its own)
MAX_PENDING_PER_ADDRESS = 2  # of them with one host and port


class PeerHandshakes:
    def __init__(self, request: Callable[[], HandshakeRequest], timeout_s: float, backoff_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 fetch: Callable[..., HandshakeResponse] = fetch_remote_layout) -> None:
        self.request = request  # made anew for each handshake (its proof holds for a while)
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.clock = clock
        self.fetch = fetch
        self._pool = ThreadPoolExecutor(MAX_PENDING, thread_name_prefix="pd-handshake")  # never queues: see start
        self._pending: dict[str, Future[HandshakeResponse]] = {}  # engine id -> its handshake
        self._addresses: dict[str, tuple[str, int]] = {}  # engine id -> where its pending handshake goes
        self._failed: dict[str, tuple[float, str]] = {}  # engine id -> (retry no sooner than, why)

    def start(self, engine_id: str, host: str, port: int) -> str | None:
        """Start a handshake with the peer unless one is under way; why it cannot start
        now (too many under way, in all or with that address), or None."""
        if engine_id in self._pending:
            return None
        if len(self._pending) >= MAX_PENDING:
            return f"{MAX_PENDING} handshakes with prefill servers are under way"
        if sum(address == (host, port) for address in self._addresses.values()) >= MAX_PENDING_PER_ADDRESS:
            return f"{MAX_PENDING_PER_ADDRESS} handshakes with {host}:{port} are under way"
        self._addresses[engine_id] = (host, port)
        self._pending[engine_id] = self._pool.submit(self._timed_fetch, host, port)
        return None

    def _timed_fetch(self, host: str, port: int) -> tuple[HandshakeResponse, float]:
        started = time.monotonic()
        response = self.fetch(host, port, self.request(), self.timeout_s)
        return response, time.monotonic() - started

    def failed_recently(self, engine_id: str) -> str | None:
        """Why the last handshake with this peer failed, while its back-off lasts."""
        failed = self._failed.get(engine_id)
        if failed is None or self.clock() >= failed[0]:
            return None
        return failed[1]

    def mark_failed(self, engine_id: str, why: str) -> None:
        now = self.clock()
        if len(self._failed) > 4 * MAX_PENDING:  # forged engine ids must not grow it without bound
            self._failed = {k: v for k, v in self._failed.items() if v[0] > now}
        self._failed[engine_id] = (now + self.backoff_s, why)

    def completed(self) -> list[tuple[str, HandshakeResponse | Exception, float]]:
        """The handshakes that ended since the last call: (peer, its response or the
        exception it failed with (then remembered for the back-off), seconds it took)."""
        done = [(engine_id, future) for engine_id, future in self._pending.items() if future.done()]
        outcomes: list[tuple[str, HandshakeResponse | Exception, float]] = []
        for engine_id, future in done:
            del self._pending[engine_id]
            self._addresses.pop(engine_id, None)
            error = future.exception()
            if error is not None:
                self.mark_failed(engine_id, str(error))
                outcomes.append((engine_id, error, 0.0))
            else:
                outcomes.append((engine_id, *future.result()))
        return outcomes

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
