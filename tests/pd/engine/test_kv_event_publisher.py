"""The engine's KV events publisher on real ZMQ sockets: numbered batches to
subscribers, replays from the kept batches, a snapshot when they are gone, and requests
that are not replay requests dropped without an answer."""

from __future__ import annotations

import time

import pytest
import zmq

from kv_events.messages import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ReplayRequest,
    batch_decoder,
    encode,
    replay_reply_decoder,
)
from launch import free_port
from pd.engine.kv_event_publisher import KVEventPublisher

HASHES = [bytes([k]) * 32 for k in range(8)]



@pytest.fixture
def publisher():
    snapshot = [BlockStored(HASHES[:2], None, 32, 0)]
    port, replay_port = free_port(), free_port()
    publisher = KVEventPublisher("engine-a", "127.0.0.1", port, replay_port, lambda: snapshot, buffer_steps=2)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    time.sleep(0.3)  # let the subscription reach the publisher
    yield publisher, sub, dealer
    sub.close(linger=0)
    dealer.close(linger=0)
    context.term()
    publisher.close()


def replay(publisher, dealer, start_seq: int):
    dealer.send(encode(ReplayRequest(start_seq)))
    for _ in range(100):
        publisher.serve_replays()
        if dealer.poll(20):
            return replay_reply_decoder.decode(dealer.recv()).batches
    raise AssertionError("no replay answer")


def test_batches_are_numbered_replayed_and_snapshot_when_gone(publisher) -> None:
    publisher, sub, dealer = publisher
    steps = [[BlockStored(HASHES[:2], None, 32, 0)], [], [BlockRemoved(HASHES[:1], 0)], [AllBlocksCleared()]]
    for events in steps:
        publisher.publish(events)  # a step that changed nothing sends nothing
    received = [batch_decoder.decode(sub.recv()) for _ in range(3)]
    assert [(b.engine_id, b.seq, b.events) for b in received] == [
        ("engine-a", 1, steps[0]), ("engine-a", 2, steps[2]), ("engine-a", 3, steps[3])]
    assert not sub.poll(50)
    assert [b.seq for b in replay(publisher, dealer, 2)] == [2, 3]  # still kept
    assert replay(publisher, dealer, 4) == []  # nothing newer
    (snapshot,) = replay(publisher, dealer, 1)  # batch 1 is gone (2 kept): the state at 3
    assert snapshot.snapshot and snapshot.seq == 3
    assert snapshot.events == [AllBlocksCleared(), BlockStored(HASHES[:2], None, 32, 0)]


def test_a_request_that_is_not_a_replay_request_is_dropped(publisher) -> None:
    publisher, sub, dealer = publisher
    dealer.send(b"\x93not msgpack of a request")
    deadline = time.monotonic() + 30
    while publisher.malformed_requests == 0 and time.monotonic() < deadline:  # until it has arrived
        publisher.serve_replays()
        time.sleep(0.01)
    assert publisher.malformed_requests == 1 and not dealer.poll(50)
    publisher.publish([BlockStored(HASHES[:1], None, 16, 0)])
    assert [b.seq for b in replay(publisher, dealer, 1)] == [1]  # still answering


@pytest.mark.parametrize("raw", [bytes.fromhex("81a1ff01"), b"\xc1", b"\x91" * 500 + b"\x01", b""])
def test_any_bytes_to_the_replay_socket_are_dropped_and_counted(publisher, raw) -> None:
    """A map whose key is not UTF-8 raised UnicodeDecodeError, not msgspec's DecodeError,
    out of serve_replays (it stopped the engine)."""
    publisher, sub, dealer = publisher
    dealer.send(raw)
    dealer.send_multipart([b"two", b"frames", b"more"])
    deadline = time.monotonic() + 30
    while publisher.malformed_requests < 2 and time.monotonic() < deadline:
        publisher.serve_replays()
        time.sleep(0.01)
    assert publisher.malformed_requests == 2 and not dealer.poll(50)
    publisher.publish([BlockStored(HASHES[:1], None, 16, 0)])
    assert [b.seq for b in replay(publisher, dealer, 1)] == [1]


def test_a_replay_client_that_does_not_read_has_its_replies_dropped(publisher) -> None:
    """Replies to a client that never reads are bounded (REPLAY_HWM queued, the rest
    dropped and counted): unbounded, 8 such clients grew the engine by 1.1 GB."""
    publisher, sub, _ = publisher
    dealer = sub.context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVHWM, 1)  # its ZMQ reads no further ahead than one reply either
    dealer.connect(publisher._replay.getsockopt_string(zmq.LAST_ENDPOINT))
    many = [bytes([k % 256, k // 256]) * 16 for k in range(20_000)]  # 640 kB of hashes per snapshot
    publisher.snapshot = lambda: [BlockStored(many, None, 16 * len(many), 0)]
    publisher.publish([AllBlocksCleared()])
    publisher.buffer.clear()  # batch 1 gone: each reply is a snapshot
    for _ in range(200):  # 128 MB of replies, were they all queued
        dealer.send(encode(ReplayRequest(1)))
    deadline = time.monotonic() + 30
    while publisher.dropped_replies < 150 and time.monotonic() < deadline:
        publisher.serve_replays()
        time.sleep(0.01)
    dealer.close(linger=0)
    assert publisher.dropped_replies >= 150  # REPLAY_HWM queued, plus what the kernel buffers hold


def test_a_reply_holds_a_bounded_run_of_batches_and_the_client_asks_on(publisher, monkeypatch) -> None:
    from pd.engine import kv_event_publisher

    publisher, sub, dealer = publisher
    publisher.buffer = type(publisher.buffer)(maxlen=100)
    for _ in range(10):
        publisher.publish([BlockStored(HASHES[:1], None, 16, 0)])
    size = len(encode(publisher.buffer[0][0]))
    monkeypatch.setattr(kv_event_publisher, "MAX_REPLY_BYTES", 3 * size)
    assert [b.seq for b in replay(publisher, dealer, 2)] == [2, 3, 4]
    assert [b.seq for b in replay(publisher, dealer, 5)] == [5, 6, 7]


def test_one_turn_answers_a_bounded_share_of_a_flood_and_builds_a_snapshot_once(publisher, monkeypatch) -> None:
    """A client asking without pause cannot make one engine turn encode without bound: a
    turn reads MAX_REQUESTS_PER_TURN requests at most and answers MAX_REPLY_BYTES (the
    rest wait for the next turns), and a snapshot is built once per batch number."""
    from pd.engine import kv_event_publisher

    publisher, sub, dealer = publisher
    built = []
    publisher.snapshot = lambda: built.append(1) or [BlockStored(HASHES, None, 16 * len(HASHES), 0)]
    for _ in range(3):
        publisher.publish([AllBlocksCleared()])  # batch 1 gone (2 kept): replies are snapshots
    reply_bytes = len(publisher._reply(1))
    monkeypatch.setattr(kv_event_publisher, "MAX_REPLY_BYTES", 3 * reply_bytes)
    for _ in range(100):
        dealer.send(encode(ReplayRequest(1)))
    time.sleep(0.5)  # all 100 queued at the publisher
    publisher.serve_replays()
    replies = 0
    while dealer.poll(200):
        dealer.recv()
        replies += 1
    assert replies + publisher.dropped_replies == 3 and built == [1]  # sent, or past REPLAY_HWM unread
    monkeypatch.setattr(kv_event_publisher, "MAX_REPLY_BYTES", 1000 * reply_bytes)
    publisher.serve_replays()
    while dealer.poll(200):
        dealer.recv()
        replies += 1
    assert replies + publisher.dropped_replies == 3 + kv_event_publisher.MAX_REQUESTS_PER_TURN and built == [1]


def test_the_null_publisher_and_the_publisher_are_siblings_with_counters_of_their_own(publisher) -> None:
    """Both are `KVEvents`, neither the other; a count kept by one instance is not seen by
    another (they were class attributes of the null publisher, inherited)."""
    from pd.engine.kv_event_publisher import KVEvents, NoKVEvents

    publisher, _, _ = publisher
    nothing = NoKVEvents()
    assert isinstance(publisher, KVEvents) and isinstance(nothing, KVEvents)
    assert not isinstance(publisher, NoKVEvents)
    publisher.malformed_requests += 1
    nothing.dropped_replies += 1
    assert (nothing.malformed_requests, NoKVEvents().dropped_replies, nothing.endpoints) == (0, 0, None)
    assert set(publisher.endpoints) == {"publisher", "replay"}
