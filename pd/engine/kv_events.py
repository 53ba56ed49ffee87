"""The engine's KV events publisher (the wire format: kv_events/).

Each step's prefix-cache changes go out as one numbered `EventBatch` on a ZMQ PUB
socket; the last `buffer_steps` batches are kept, and a ROUTER socket answers replay
requests from them, or with a snapshot of every block cached now when the range asked
for is gone. The engine loop calls `serve_replays` every turn (it never blocks), and the
core `publish`es after each step.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import msgspec
import zmq

from kv_events.messages import (
    AllBlocksCleared,
    EventBatch,
    KVEvent,
    ReplayReply,
    encode,
    replay_request_decoder,
)

logger = logging.getLogger(__name__)

BUFFER_STEPS = 10_000  # batches kept for replays


class NoKVEvents:
    """An engine without `--kv-events-port`: publishes nothing."""

    def publish(self, events: list[KVEvent]) -> None:
        pass

    def serve_replays(self) -> None:
        pass

    def close(self) -> None:
        pass


class KVEventPublisher(NoKVEvents):
    """`snapshot()` gives the events that store every block cached now."""

    def __init__(self, engine_id: str, host: str, port: int, replay_port: int,
                 snapshot: Callable[[], list[KVEvent]], buffer_steps: int = BUFFER_STEPS) -> None:
        self.engine_id = engine_id
        self.snapshot = snapshot
        self.seq = 0
        self.buffer: deque[EventBatch] = deque(maxlen=buffer_steps)
        self.malformed_requests = 0
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)  # a slow subscriber loses batches (and asks again), never blocks a step
        self._pub.bind(f"tcp://{host}:{port}")
        self._replay = self._context.socket(zmq.ROUTER)
        self._replay.bind(f"tcp://{host}:{replay_port}")

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        self.seq += 1
        batch = EventBatch(self.engine_id, self.seq, events)
        self.buffer.append(batch)
        try:
            self._pub.send(encode(batch), zmq.NOBLOCK)
        except zmq.Again:  # past the high-water mark: subscribers see the gap and replay
            pass

    def serve_replays(self) -> None:
        """Answer every replay request queued (without waiting for any)."""
        while self._replay.poll(0, zmq.POLLIN):
            frames = self._replay.recv_multipart()
            try:
                request = replay_request_decoder.decode(frames[-1])
            except (msgspec.DecodeError, IndexError):  # not a replay request: dropped, never answered
                self.malformed_requests += 1
                continue
            reply = ReplayReply(self._batches_from(request.start_seq))
            self._replay.send_multipart([*frames[:-1], encode(reply)])

    def _batches_from(self, start_seq: int) -> list[EventBatch]:
        if start_seq > self.seq:
            return []
        if self.buffer and self.buffer[0].seq <= start_seq:
            return [b for b in self.buffer if b.seq >= start_seq]
        return [EventBatch(self.engine_id, self.seq, [AllBlocksCleared(), *self.snapshot()], snapshot=True)]

    def close(self) -> None:
        self._pub.close(linger=0)
        self._replay.close(linger=0)
        self._context.term()
