"""Handshakes off the engine step (connectors/nixl/peers.py), with a stand-in for the
side-channel exchange so that the test decides when each one answers."""

from __future__ import annotations

import threading
import time

from connectors.nixl.peer_messages import HandshakeRequest
from connectors.nixl.peers import PeerHandshakes


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


class Gate:
    """A fetch that blocks until released, counting calls per port."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.calls: list[int] = []

    def __call__(self, host, port, request, timeout_s):
        self.calls.append(port)
        self.open.wait(5)
        if port == 666:
            raise RuntimeError("no handshake reply")
        return f"layout of {port}"


def wait_completed(handshakes: PeerHandshakes, n: int) -> list:
    done, end = [], time.monotonic() + 5
    while len(done) < n and time.monotonic() < end:
        done += handshakes.completed()
        time.sleep(0.005)
    return done


def test_handshakes_run_in_parallel_once_per_peer_and_failures_back_off() -> None:
    gate, clock = Gate(), Clock()
    handshakes = PeerHandshakes(lambda: HandshakeRequest("D", "h"), 5.0, backoff_s=10.0, clock=clock, fetch=gate)
    try:
        handshakes.start("P1", "127.0.0.1", 1)
        handshakes.start("P1", "127.0.0.1", 1)  # one at a time per peer
        handshakes.start("P9", "127.0.0.1", 666)
        end = time.monotonic() + 5
        while len(gate.calls) < 2 and time.monotonic() < end:
            time.sleep(0.005)
        assert sorted(gate.calls) == [1, 666]  # both under way together: neither waits for the other
        assert handshakes.completed() == [] and handshakes.num_pending == 2  # nothing blocks the caller
        gate.open.set()
        outcomes = {engine_id: outcome for engine_id, outcome, _ in wait_completed(handshakes, 2)}
        assert outcomes["P1"] == "layout of 1" and isinstance(outcomes["P9"], RuntimeError)
        assert handshakes.failed_recently("P9") == "no handshake reply" and handshakes.failed_recently("P1") is None
        clock.now += 10.0
        assert handshakes.failed_recently("P9") is None  # the back-off is over
    finally:
        handshakes.close()


def test_handshakes_never_queue_past_their_bounds_they_are_refused_at_once(monkeypatch) -> None:
    """Issue 31 row 6: 40 forged engine ids that never answer queued every other
    handshake behind them (4 at a time): a request behind a restarted P waited 49 s."""
    from connectors.nixl import peers

    monkeypatch.setattr(peers, "MAX_PENDING", 6)
    gate = Gate()
    handshakes = PeerHandshakes(lambda: HandshakeRequest("D", "h"), 5.0, backoff_s=10.0, fetch=gate)
    try:
        assert handshakes.start("F1", "127.0.0.1", 7) is None and handshakes.start("F2", "127.0.0.1", 7) is None
        assert "127.0.0.1:7 are under way" in handshakes.start("F3", "127.0.0.1", 7)  # per address
        for k in range(4):
            assert handshakes.start(f"G{k}", "127.0.0.1", 100 + k) is None
        assert "6 handshakes" in handshakes.start("P", "127.0.0.1", 1)  # in all: refused, not queued
        end = time.monotonic() + 5
        while len(gate.calls) < 6 and time.monotonic() < end:
            time.sleep(0.005)
        assert len(gate.calls) == 6  # every one started at once, none waits for a thread
        gate.open.set()
        wait_completed(handshakes, 6)
        assert handshakes.num_pending == 0 and handshakes.start("P", "127.0.0.1", 1) is None
    finally:
        gate.open.set()
        handshakes.close()
