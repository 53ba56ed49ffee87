"""NIXL connector messages: msgpack round trips, strict decoding, the compat hash."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connectors.nixl.peer_messages import (
    MAX_RANKS,
    DataRefInfo,
    HandshakeError,
    HandshakeRequest,
    HandshakeResponse,
    KVLayoutInfo,
    MessageDecodeError,
    NotifDecodeError,
    PieceInfo,
    RankAgent,
    ReadDone,
    Reject,
    TensorInfo,
    decode_notif,
    decode_reply,
    decode_request,
    encode,
    encode_notif,
    rank_agent_name,
)


def layout(**changes) -> KVLayoutInfo:
    fields = dict(
        engine_id="P-0",
        tensors=[TensorInfo(0x7F0000000000, 100, 4096), TensorInfo(0x7F1000000000, 100, 4096, device_id=1)],
        group_data_refs=[[DataRefInfo(0, 4096)], [DataRefInfo(1, 2048, 1024)]],
        block_sizes=[16, 32],
        compat_hash="ab" * 32,
        device_kind="VRAM",
    )
    return KVLayoutInfo(**(fields | changes))


def test_handshake_messages_round_trip() -> None:
    request = HandshakeRequest("D-1", "cd" * 32)
    assert decode_request(encode(request)) == request
    response = HandshakeResponse(b"\x00agent-metadata\xff", layout())
    assert decode_reply(encode(response)) == response
    error = HandshakeError("incompatible KV layout: nope")
    assert decode_reply(encode(error)) == error


def test_notifications_round_trip_as_a_tagged_union() -> None:
    for notif in (ReadDone("req-1"), Reject("req-2", "aborted by the client")):
        decoded = decode_notif(encode_notif(notif))
        assert decoded == notif and type(decoded) is type(notif)
    # The tag is on the wire: a ReadDone is not mistaken for anything else.
    assert msgspec.msgpack.decode(encode_notif(ReadDone("x"))) == {"type": "read_done", "request_id": "x"}


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x00",
        b"\xc1",  # never-used msgpack byte
        msgspec.msgpack.encode({"type": "read_done"}),  # field missing
        msgspec.msgpack.encode({"type": "read_done", "request_id": 7}),  # wrong type
        msgspec.msgpack.encode({"type": "explode", "request_id": "x"}),  # unknown tag
        msgspec.msgpack.encode({"request_id": "x"}),  # no tag
        msgspec.msgpack.encode(["read_done", "x"]),
        encode(HandshakeRequest("D", "h")),  # a valid message, but not a notification
    ],
)
def test_malformed_notifications_raise_the_specific_error(payload: bytes) -> None:
    with pytest.raises(NotifDecodeError):
        decode_notif(payload)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_any_bytes_decode_to_a_notification_or_the_specific_error(payload: bytes) -> None:
    try:
        notif = decode_notif(payload)
    except NotifDecodeError:
        return
    assert isinstance(notif, (ReadDone, Reject))


def test_a_layout_from_the_network_is_validated() -> None:
    good = msgspec.msgpack.decode(encode(HandshakeResponse(b"m", layout())))
    assert decode_reply(msgspec.msgpack.encode(good)) == HandshakeResponse(b"m", layout())
    bad_cases = [
        ("tensors", [{"base_address": -1, "num_blocks": 1, "row_bytes": 1}]),  # negative address
        ("group_data_refs", [[{"tensor_idx": 5, "page_size_bytes": 8}], [{"tensor_idx": 1, "page_size_bytes": 8}]]),
        ("group_data_refs", [[{"tensor_idx": 0, "page_size_bytes": 4097}], [{"tensor_idx": 1, "page_size_bytes": 8}]]),
        ("block_sizes", [16]),  # one block size for two groups
        ("device_kind", "FILE"),
        ("group_pieces", [[["head", 0, 0, 8]]]),  # pieces for one group of two
        ("group_pieces", [[["head", 0, 0, 4097]], [["head", 0, 0, 8]]]),  # past the 4096-byte ref
        ("group_pieces", [[["head", 0, 0, 4], ["head", 0, 4, 4]], [["head", 0, 0, 8]]]),  # a head twice
        ("group_pieces", [[["layer", 0, 0, 8]], [["head", 0, 0, 8]]]),  # not a kind of piece
        ("group_pieces", [[["head", -1, 0, 8]], [["head", 0, 0, 8]]]),
    ]
    for key, value in bad_cases:
        data = dict(good, layout=dict(good["layout"], **{key: value}))
        with pytest.raises(MessageDecodeError):
            decode_reply(msgspec.msgpack.encode(data))
    with pytest.raises(MessageDecodeError):
        decode_request(encode(HandshakeError("a reply is not a request")))


def test_a_layout_s_pieces_travel() -> None:
    pieces = [[PieceInfo("head", 0, 0, 2048), PieceInfo("head", 1, 2048, 2048)], [PieceInfo("shared", 0, 0, 1024)]]
    sent = HandshakeResponse(b"m", layout(group_pieces=pieces))
    assert decode_reply(encode(sent)).layout.group_pieces == pieces


def test_layout_checks_its_refs_when_built() -> None:
    with pytest.raises(ValueError, match="names tensor 2"):
        layout(group_data_refs=[[DataRefInfo(2, 8)], [DataRefInfo(0, 8)]])
    with pytest.raises(ValueError, match="runs past the row"):
        layout(group_data_refs=[[DataRefInfo(0, 4096, 1)], [DataRefInfo(0, 8)]])
    assert layout(block_sizes=[]).block_sizes == []  # not stated is allowed


def test_every_ranks_agent_travels_and_a_bad_rank_is_refused_at_decode() -> None:
    """A tensor-parallel P describes ranks 1..N-1 beside rank 0; their layouts are
    validated as rank 0's, and a list longer than MAX_RANKS - 1 is refused."""
    ranks = [RankAgent(b"rank-1", layout(engine_id="P-0-tp1")), RankAgent(b"rank-2", layout(engine_id="P-0-tp2"))]
    sent = HandshakeResponse(b"m", layout(), ranks)
    received = decode_reply(encode(sent))
    assert received == sent
    assert [a.layout.engine_id for a in received.agents] == ["P-0", "P-0-tp1", "P-0-tp2"]
    assert [rank_agent_name("P-0", r) for r in range(3)] == ["P-0", "P-0-tp1", "P-0-tp2"]
    good = msgspec.msgpack.decode(encode(sent))
    bad_rank = dict(good["ranks"][0], layout=dict(good["ranks"][0]["layout"], block_sizes=[16]))
    too_many = [good["ranks"][0]] * MAX_RANKS
    for ranks_field in ([bad_rank], too_many, [{"agent_metadata": b"x"}], "not a list"):
        with pytest.raises(MessageDecodeError):
            decode_reply(msgspec.msgpack.encode(dict(good, ranks=ranks_field)))


_REPLY_WITH_RANKS = encode(HandshakeResponse(b"m", layout(), [RankAgent(b"r", layout(engine_id="P-0-tp1"))]))


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_any_mutation_of_a_reply_with_ranks_decodes_or_raises_the_specific_error(data) -> None:
    """Bytes flipped, cut or inserted anywhere in a reply describing two ranks: a reply
    (validated) or MessageDecodeError, never another exception."""
    payload = bytearray(_REPLY_WITH_RANKS)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(payload) - 1))
        action = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if action == "flip":
            payload[at] ^= data.draw(st.integers(1, 255))
        elif action == "cut":
            del payload[at:at + data.draw(st.integers(1, 8))]
        else:
            payload[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        if not payload:
            return
    try:
        reply = decode_reply(bytes(payload))
    except MessageDecodeError:
        return
    assert isinstance(reply, (HandshakeResponse, HandshakeError))
