"""The engine's KV events publisher (the wire format: kv_events/).

Each step's prefix-cache changes go out as one numbered `EventBatch` on a ZMQ PUB
socket; the last `buffer_steps` batches are kept, and a ROUTER socket answers replay
requests from them, or with a snapshot of every block cached now when the range asked
for is gone. The engine loop calls `serve_replays` every turn (it never blocks), and the
core `publish`es after each step.

Whoever can reach the ports may send anything, and may never read: nothing received
stops the engine, and what the publisher keeps for others is bounded. A request that is
not a replay request (any bytes, any frames) is dropped and counted. Each replay client
has at most `REPLAY_HWM` replies queued; past that its replies are dropped (it does not
read) and counted. A reply holds at most `MAX_REPLY_BYTES` of batches (a client asks
again from where it ended), and at most `MAX_REPLAY_CLIENTS` clients are answered per
`CLIENT_WINDOW_S`. What the engine does for replays in one turn is bounded too: at most
`MAX_REQUESTS_PER_TURN` requests read and `MAX_REPLY_BYTES` answered (one reply at
least; the rest wait in the socket for the next turn, ZMQ serving its clients in turn),
and a snapshot is built once per sequence number, however many ask for it. A
subscriber that falls `PUB_HWM` batches behind loses batches (it sees the gap and asks
for a replay).
"""

from __future__ import annotations

import itertools
import logging
import time
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable

import zmq

from kv_events.messages import (
    AllBlocksCleared,
    EventBatch,
    KVEvent,
    MalformedMessage,
    ReplayReply,
    decode,
    encode,
    replay_request_decoder,
)

logger = logging.getLogger(__name__)

BUFFER_STEPS = 10_000  # batches kept for replays
PUB_HWM = 10_000  # batches queued per subscriber before it loses some
REPLAY_HWM = 2  # replies queued per replay client before its next ones are dropped
MAX_REPLY_BYTES = 4 << 20  # of batches in one reply (one batch at least)
MAX_REQUEST_BYTES = 1024  # ZMQ drops the connection of a peer sending a larger message
MAX_REPLAY_CLIENTS = 64  # clients answered per CLIENT_WINDOW_S; others' requests are dropped
CLIENT_WINDOW_S = 10.0
MAX_REQUESTS_PER_TURN = 64  # replay requests read per engine turn (answered or dropped)


class KVEvents(ABC):
    """Where the engine's prefix-cache changes go. The core calls `publish` after each
    step and the engine loop `serve_replays` every turn; neither ever blocks. `close` is
    called once, at shutdown. Each instance keeps counters of its own."""

    endpoints: dict[str, str] | None  # where events are published and replayed, as bound; None: they are not
    malformed_requests: int  # requests received that were not replay requests (dropped)
    dropped_replies: int  # replies not sent: to clients that do not read, or past MAX_REPLAY_CLIENTS

    @abstractmethod
    def publish(self, events: list[KVEvent]) -> None:
        """Send one step's events (nothing when there are none)."""

    @abstractmethod
    def serve_replays(self) -> None:
        """Answer the replay requests queued, within this turn's bounds."""

    @abstractmethod
    def close(self) -> None: ...


class NoKVEvents(KVEvents):
    """An engine without `--kv-events-port`: publishes nothing."""

    def __init__(self) -> None:
        self.endpoints = None
        self.malformed_requests = 0
        self.dropped_replies = 0

    def publish(self, events: list[KVEvent]) -> None:
        pass

    def serve_replays(self) -> None:
        pass

    def close(self) -> None:
        pass


class KVEventPublisher(KVEvents):
    """`snapshot()` gives the events that store every block cached now."""

    def __init__(self, engine_id: str, host: str, port: int, replay_port: int,
                 snapshot: Callable[[], list[KVEvent]], buffer_steps: int = BUFFER_STEPS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine_id = engine_id
        self.snapshot = snapshot
        self.clock = clock
        self.seq = 0
        self.buffer: deque[tuple[EventBatch, int]] = deque(maxlen=buffer_steps)  # (batch, its encoded bytes)
        self.malformed_requests = 0
        self.dropped_replies = 0
        self._clients: OrderedDict[bytes, float] = OrderedDict()  # routing id -> last answered
        self._snapshot: tuple[int, bytes] = (-1, b"")  # (seq, the encoded snapshot reply)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        # a slow subscriber loses batches (and asks again), never blocks a step
        self._pub.setsockopt(zmq.SNDHWM, PUB_HWM)
        self._pub.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)  # subscriptions only come in
        self._pub.bind(_endpoint(host, port))
        self._replay = self._context.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.SNDHWM, REPLAY_HWM)
        self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or vanished client raises Again, never blocks
        self._replay.bind(_endpoint(host, replay_port))
        self.endpoints = {"publisher": _bound(self._pub), "replay": _bound(self._replay)}

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        self.seq += 1
        batch = EventBatch(self.engine_id, self.seq, events)
        raw = encode(batch)
        self.buffer.append((batch, len(raw)))
        try:
            self._pub.send(raw, zmq.NOBLOCK)
        except zmq.Again:  # past the high-water mark: subscribers see the gap and replay
            pass

    def serve_replays(self) -> None:
        """Answer the replay requests queued, within this turn's bounds (never waiting)."""
        answered = 0
        for _ in range(MAX_REQUESTS_PER_TURN):
            if answered >= MAX_REPLY_BYTES or not self._replay.poll(0, zmq.POLLIN):
                return
            frames = self._replay.recv_multipart()
            try:
                if len(frames) not in (2, 3) or (len(frames) == 3 and frames[1]):  # DEALER or REQ envelope
                    raise MalformedMessage(f"{len(frames)} frames")
                request = decode(replay_request_decoder, frames[-1])
            except MalformedMessage:  # not a replay request: dropped, never answered
                self.malformed_requests += 1
                continue
            if not self._admit_client(frames[0]):
                self.dropped_replies += 1
                continue
            reply = self._reply(request.start_seq)
            answered += len(reply)
            try:
                self._replay.send_multipart([*frames[:-1], reply], zmq.NOBLOCK)
            except zmq.ZMQError:  # Again: it has REPLAY_HWM replies unread; or it left
                self.dropped_replies += 1

    def _admit_client(self, routing_id: bytes) -> bool:
        """Whether to answer this client: one answered lately, or a new one while fewer than
        MAX_REPLAY_CLIENTS were."""
        now = self.clock()
        while self._clients and next(iter(self._clients.values())) < now - CLIENT_WINDOW_S:
            self._clients.popitem(last=False)
        if routing_id not in self._clients and len(self._clients) >= MAX_REPLAY_CLIENTS:
            return False
        self._clients[routing_id] = now
        self._clients.move_to_end(routing_id)
        return True

    def _reply(self, start_seq: int) -> bytes:
        """The encoded reply: the kept batches from `start_seq` on, up to MAX_REPLY_BYTES of
        them (one at least), or a snapshot when they are gone."""
        if start_seq > self.seq:
            return encode(ReplayReply([]))
        if self.buffer and self.buffer[0][0].seq <= start_seq:
            batches, size = [], 0
            for batch, num_bytes in itertools.islice(self.buffer, start_seq - self.buffer[0][0].seq, None):
                size += num_bytes
                if batches and size > MAX_REPLY_BYTES:
                    break
                batches.append(batch)
            return encode(ReplayReply(batches))
        if self._snapshot[0] != self.seq:
            snapshot = EventBatch(self.engine_id, self.seq, [AllBlocksCleared(), *self.snapshot()], snapshot=True)
            self._snapshot = (self.seq, encode(ReplayReply([snapshot])))
        return self._snapshot[1]

    def close(self) -> None:
        self._pub.close(linger=0)
        self._replay.close(linger=0)
        self._context.term()


def _endpoint(host: str, port: int) -> str:
    """Where a socket binds: tcp://host:port, any free port for 0."""
    return f"tcp://{host}:{port or '*'}"


def _bound(socket: zmq.Socket) -> str:
    """The endpoint a socket bound (its port when it was asked for any)."""
    endpoint = socket.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
