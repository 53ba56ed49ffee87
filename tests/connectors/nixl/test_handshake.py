"""The side channel: a real ZMQ server on 127.0.0.1 answering handshakes (no NIXL here;
the agent metadata is opaque bytes to the side channel)."""

from __future__ import annotations

import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from connectors.nixl.handshake import (
    MAX_REQUEST_BYTES,
    PROOF_WINDOW_S,
    HandshakeFailed,
    SideChannelServer,
    fetch_remote_layout,
    handshake_request,
)
from connectors.nixl.peer_messages import (
    DataRefInfo,
    HandshakeError,
    HandshakeRequest,
    HandshakeResponse,
    KVLayoutInfo,
    TensorInfo,
    decode_reply,
    encode,
)
from launch import free_port

OUR_HASH = "11" * 32
LAYOUT = KVLayoutInfo("P-test", [TensorInfo(4096, 10, 256)], [[DataRefInfo(0, 256)]], [16], OUR_HASH)
RESPONSE = HandshakeResponse(b"\x01opaque agent metadata\x00", LAYOUT)


def respond(request: HandshakeRequest) -> HandshakeResponse | HandshakeError:
    """What a worker answers: its layout, or a refusal when the KV layouts differ."""
    if request.engine_id == "boom":
        raise RuntimeError("respond blew up")
    if request.compat_hash != OUR_HASH:
        return HandshakeError(f"incompatible KV layout: peer {request.engine_id!r} has "
                              f"{request.compat_hash[:12]}, this engine {OUR_HASH[:12]}")
    return RESPONSE


@pytest.fixture
def server() -> Iterator[SideChannelServer]:
    srv = SideChannelServer("127.0.0.1", 0, respond)
    try:
        yield srv
    finally:
        srv.close()


def raw_exchange(port: int, frames: list[bytes], socket_type: int = zmq.DEALER) -> bytes:
    """Send raw frames with a fresh socket; return the reply's payload frame."""
    ctx = zmq.Context()
    sock = ctx.socket(socket_type)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart(frames)
        assert sock.poll(5000), "no reply"
        return sock.recv_multipart()[-1]
    finally:
        sock.close()
        ctx.term()


def good_handshake(port: int) -> HandshakeResponse:
    return fetch_remote_layout("127.0.0.1", port, HandshakeRequest("D-test", OUR_HASH), 5.0)


def test_handshake_returns_the_layout_and_metadata(server: SideChannelServer) -> None:
    assert server.port > 0
    assert good_handshake(server.port) == RESPONSE


def test_two_servers_on_port_zero_get_different_ports() -> None:
    a = SideChannelServer("127.0.0.1", 0, respond)
    try:
        b = SideChannelServer("127.0.0.1", 0, respond)
        try:
            assert a.port != b.port
            assert good_handshake(a.port) == good_handshake(b.port) == RESPONSE
        finally:
            b.close()
    finally:
        a.close()


def test_binding_a_taken_port_raises(server: SideChannelServer) -> None:
    with pytest.raises(zmq.ZMQError):
        SideChannelServer("127.0.0.1", server.port, respond)


def test_incompatible_hash_fails_with_a_clear_reason(server: SideChannelServer) -> None:
    with pytest.raises(HandshakeFailed, match="incompatible KV layout: peer 'D-other' has 222222222222") as info:
        fetch_remote_layout("127.0.0.1", server.port, HandshakeRequest("D-other", "22" * 32), 5.0)
    assert "incompatible KV layout" in info.value.reason


@pytest.mark.parametrize(
    "frames",
    [
        [b"", b"\xc1garbage"],  # not msgpack
        [b"", msgspec.msgpack.encode({"engine_id": "D"})],  # no tag, missing field
        [b"", encode(HandshakeError("a reply, not a request"))],
        [b"", b"one", b"two"],  # two payload frames
        [b"", b"x" * (MAX_REQUEST_BYTES + 1)],  # oversized
    ],
    ids=["garbage", "wrong-shape", "wrong-type", "multipart", "oversized"],
)
def test_malformed_requests_get_an_error_and_the_server_keeps_serving(
    server: SideChannelServer, frames: list[bytes]
) -> None:
    reply = decode_reply(raw_exchange(server.port, frames))
    assert isinstance(reply, HandshakeError)
    assert "malformed" in reply.reason or "exceeds" in reply.reason
    assert good_handshake(server.port) == RESPONSE


def test_a_req_client_is_served_too(server: SideChannelServer) -> None:
    reply = raw_exchange(server.port, [encode(HandshakeRequest("D-req", OUR_HASH))], zmq.REQ)
    assert decode_reply(reply) == RESPONSE


def test_respond_raising_becomes_an_error_reply(server: SideChannelServer) -> None:
    with pytest.raises(HandshakeFailed, match="internal error"):
        fetch_remote_layout("127.0.0.1", server.port, HandshakeRequest("boom", OUR_HASH), 5.0)
    assert good_handshake(server.port) == RESPONSE


def test_no_server_times_out() -> None:
    port = free_port()  # a port nobody listens on
    with pytest.raises(HandshakeFailed, match="no handshake reply .* within 0.3 s"):
        fetch_remote_layout("127.0.0.1", port, HandshakeRequest("D", OUR_HASH), 0.3)


def test_an_undecodable_reply_fails_the_handshake() -> None:
    """A server that answers garbage (not ours: a bare ROUTER in a thread)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def answer_garbage() -> None:
        if router.poll(5000):
            identity, *_ = router.recv_multipart()
            router.send_multipart([identity, b"", b"\xc1not msgpack"])

    thread = threading.Thread(target=answer_garbage)
    thread.start()
    try:
        with pytest.raises(HandshakeFailed, match="undecodable handshake reply"):
            fetch_remote_layout("127.0.0.1", port, HandshakeRequest("D", OUR_HASH), 5.0)
    finally:
        thread.join()
        router.close()
        ctx.term()


def test_idle_server_does_not_spin_and_close_frees_the_port() -> None:
    srv = SideChannelServer("127.0.0.1", 0, respond)
    try:
        cpu_before = time.process_time()
        time.sleep(1.0)
        idle_cpu = time.process_time() - cpu_before
    finally:
        srv.close()
    assert idle_cpu < 0.1, f"idle side channel used {idle_cpu:.3f} s of CPU in 1 s"
    assert not srv._thread.is_alive()
    srv.close()  # idempotent
    again = SideChannelServer("127.0.0.1", srv.port, respond)  # the port is free again
    again.close()


@pytest.mark.parametrize("peers, answered", [
    (["127.0.0.0/8"], True),
    (["127.0.0.1"], True),
    (["10.0.0.0/8", "::1/128"], False),  # the request comes from 127.0.0.1: not a peer
    (None, True),
])
def test_only_peers_addresses_are_answered(peers, answered) -> None:
    with SideChannelServer("127.0.0.1", 0, respond, peers=peers) as server:
        if answered:
            assert good_handshake(server.port) == RESPONSE
        else:
            with pytest.raises(HandshakeFailed, match="127.0.0.1 is not an allowed peer of this server"):
                good_handshake(server.port)
        assert server.refused == (0 if answered else 1) and server.malformed == 0
        assert good_handshake(server.port) == RESPONSE if answered else server.refused == 1


def test_with_a_secret_only_a_fresh_proof_of_it_is_answered() -> None:
    now = [1_000_000.0]
    with SideChannelServer("127.0.0.1", 0, respond, key="s3cret", wall_clock=lambda: now[0]) as server:
        def ask(request: HandshakeRequest) -> HandshakeResponse:
            return fetch_remote_layout("127.0.0.1", server.port, request, 5.0)

        assert ask(handshake_request("D", OUR_HASH, "s3cret", lambda: now[0] - 10)) == RESPONSE
        refused = {
            "no proof": HandshakeRequest("D", OUR_HASH, now[0]),
            "another key": handshake_request("D", OUR_HASH, "other", lambda: now[0]),
            "stale": handshake_request("D", OUR_HASH, "s3cret", lambda: now[0] - PROOF_WINDOW_S - 1),
            "from the future": handshake_request("D", OUR_HASH, "s3cret", lambda: now[0] + PROOF_WINDOW_S + 1),
            "not a number": handshake_request("D", OUR_HASH, "s3cret", lambda: float("nan")),
            "proof moved to another engine": msgspec.structs.replace(
                handshake_request("D", OUR_HASH, "s3cret", lambda: now[0]), engine_id="D2"),
            "not ascii": HandshakeRequest("D", OUR_HASH, now[0], "\u00e9" * 64),
        }
        for name, request in refused.items():
            with pytest.raises(HandshakeFailed, match="prove the deployment's transfer secret|proof was made"):
                ask(request)
            assert server.refused == list(refused).index(name) + 1, name
        assert ask(handshake_request("D", OUR_HASH, "s3cret", lambda: now[0])) == RESPONSE  # still serving
