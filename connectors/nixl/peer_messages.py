"""What NIXL connectors say to each other: side-channel handshakes and notifications.

Everything here is a msgspec Struct sent as msgpack. Nothing from the network is ever
unpickled: a decoder accepts exactly these types, and any other bytes raise a
`MessageDecodeError` (a `ValueError`) that the receiver can catch and log.

- Side channel (ZMQ, see `handshake.py`): D sends a `HandshakeRequest`; P answers with a
  `HandshakeResponse` (its NIXL agent metadata and KV layout, one per tensor-parallel
  rank) or a `HandshakeError`.
- Notifications (bytes carried by NIXL, see `transport.py`): `ReadDone` tells P that D
  read the blocks and checked P's lease word (leases.py); `Reject` that D will not read; `KeepAlive`
  tells P that D still will (the request waits in D's queue): P extends the lease.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(gt=0)]
DeviceKind = Literal["DRAM", "VRAM"]


class MessageDecodeError(ValueError):
    """Bytes that are not a valid message of the expected type."""


class NotifDecodeError(MessageDecodeError):
    """A NIXL notification payload that is not a `ReadDone` or a `Reject`."""


# --- KV layout ---------------------------------------------------------------------


class TensorInfo(msgspec.Struct, frozen=True):
    """One registered KV tensor: `num_blocks` rows of `row_bytes`, back to back."""

    base_address: NonNegative
    num_blocks: Positive
    row_bytes: Positive
    device_id: NonNegative = 0


class DataRefInfo(msgspec.Struct, frozen=True):
    """Where one group's data is in a row of tensor `tensor_idx` (see `KVCacheBlockDataRef`)."""

    tensor_idx: NonNegative
    page_size_bytes: Positive
    offset_bytes: NonNegative = 0


class PieceInfo(msgspec.Struct, frozen=True, array_like=True):
    """Bytes `[offset, offset + nbytes)` of each ref of a group hold head (or, for
    `kind="shared"`, Mamba group) `index` (see `pd/kv_cache/row_order.py`)."""

    kind: Literal["head", "shared"]
    index: NonNegative
    offset: NonNegative
    nbytes: Positive


class KVLayoutInfo(msgspec.Struct, frozen=True):
    """An engine's KV cache as a peer needs it to build READ descriptors.

    `group_data_refs[g]` are the refs of KV cache group g; `block_sizes[g]` its tokens per
    block (an empty list: not stated). `compat_hash` (pd/kv_transfer/compat.py) is equal
    on two engines iff they may exchange KV blocks. `group_pieces[g]`, when given, says
    which heads each ref of group g holds where: a worker holding other heads (another
    tensor-parallel size) reads only the pieces it lacks.
    """

    engine_id: str
    tensors: list[TensorInfo]
    group_data_refs: list[list[DataRefInfo]]
    block_sizes: list[Positive]
    compat_hash: str
    device_kind: DeviceKind = "DRAM"
    lease_words: TensorInfo | None = None  # its lease table (leases.py), host memory, one 8-byte word a row
    group_pieces: list[list[PieceInfo]] = []

    def __post_init__(self) -> None:
        # Runs on decode too: a layout from the network that names a missing tensor or
        # overruns a row raises msgspec.ValidationError there, so it never reaches NIXL.
        if self.block_sizes and len(self.block_sizes) != len(self.group_data_refs):
            raise ValueError(f"{len(self.block_sizes)} block sizes for {len(self.group_data_refs)} groups")
        for group_id, refs in enumerate(self.group_data_refs):
            if not refs:
                raise ValueError(f"group {group_id} has no data refs")
            for ref in refs:
                if ref.tensor_idx >= len(self.tensors):
                    raise ValueError(f"group {group_id}: {ref} names tensor {ref.tensor_idx} of {len(self.tensors)}")
                row = self.tensors[ref.tensor_idx].row_bytes
                if ref.offset_bytes + ref.page_size_bytes > row:
                    raise ValueError(f"group {group_id}: {ref} runs past the row of {row} bytes")
        self._check_pieces()

    def _check_pieces(self) -> None:
        if not self.group_pieces:
            return
        if len(self.group_pieces) != len(self.group_data_refs):
            raise ValueError(f"{len(self.group_pieces)} piece lists for {len(self.group_data_refs)} groups")
        for group_id, (refs, pieces) in enumerate(zip(self.group_data_refs, self.group_pieces)):
            size = min(ref.page_size_bytes for ref in refs)
            if any(p.offset + p.nbytes > size for p in pieces):
                raise ValueError(f"group {group_id}: a piece runs past its {size}-byte ref")
            if len({(p.kind, p.index) for p in pieces}) != len(pieces):
                raise ValueError(f"group {group_id}: a piece is named twice")


# --- side channel --------------------------------------------------------------------


class HandshakeRequest(msgspec.Struct, frozen=True, tag="handshake_request"):
    engine_id: str
    compat_hash: str
    sent_at: float = 0.0  # the sender's wall clock (seconds since the epoch), under the proof
    proof: str = ""  # with a deployment's secret: pd/kv_transfer/signing.py `handshake_proof`


MAX_RANKS = 256  # tensor-parallel ranks a handshake may describe


class RankAgent(msgspec.Struct, frozen=True):
    """One tensor-parallel rank's NIXL agent and the KV layout of its heads."""

    agent_metadata: bytes
    layout: KVLayoutInfo


class HandshakeResponse(msgspec.Struct, frozen=True, tag="handshake_response"):
    """P's rank 0 agent and layout; with tensor parallelism, `ranks` are ranks 1..N-1's
    (each holds other heads of the same blocks; their layouts name engine id
    `<P's engine id>-tp<rank>`)."""

    agent_metadata: bytes
    layout: KVLayoutInfo
    ranks: Annotated[list[RankAgent], msgspec.Meta(max_length=MAX_RANKS - 1)] = []

    @property
    def agents(self) -> list[RankAgent]:
        """Every rank's agent and layout, rank 0 first."""
        return [RankAgent(self.agent_metadata, self.layout), *self.ranks]


def rank_agent_name(engine_id: str, rank: int) -> str:
    """The NIXL agent (and layout engine id) of an engine's tensor-parallel rank."""
    return engine_id if rank == 0 else f"{engine_id}-tp{rank}"


class HandshakeError(msgspec.Struct, frozen=True, tag="handshake_error"):
    reason: str


HandshakeReply = Union[HandshakeResponse, HandshakeError]

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(HandshakeRequest)
_reply_decoder = msgspec.msgpack.Decoder(HandshakeReply)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_request(data: bytes) -> HandshakeRequest:
    """Raises MessageDecodeError unless `data` is a HandshakeRequest."""
    return _decode(_request_decoder, data, MessageDecodeError)


def decode_reply(data: bytes) -> HandshakeReply:
    """Raises MessageDecodeError unless `data` is a HandshakeResponse or a HandshakeError."""
    return _decode(_reply_decoder, data, MessageDecodeError)


# --- notifications ---------------------------------------------------------------------


class ReadDone(msgspec.Struct, frozen=True, tag="read_done"):
    """D finished reading P's blocks for `request_id` (P's id): P may free them."""

    request_id: str


class Reject(msgspec.Struct, frozen=True, tag="reject"):
    """D will not read P's blocks for `request_id` (P's id): P may free them."""

    request_id: str
    reason: str


class KeepAlive(msgspec.Struct, frozen=True, tag="keep_alive"):
    """D still means to read P's blocks for `request_id` (P's id), which wait in D's
    queue: P extends their lease by its full length from now."""

    request_id: str


Notif = Union[ReadDone, Reject, KeepAlive]
_notif_decoder = msgspec.msgpack.Decoder(Notif)


def encode_notif(notif: Notif) -> bytes:
    return _encoder.encode(notif)


def decode_notif(data: bytes) -> Notif:
    """Raises NotifDecodeError unless `data` is a ReadDone, a Reject or a KeepAlive."""
    return _decode(_notif_decoder, data, NotifDecodeError)


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes, error: type[MessageDecodeError]):
    try:
        return decoder.decode(data)
    except Exception as exc:  # whatever the decoder raises (UnicodeDecodeError too), not one type
        raise error(f"malformed message ({len(data)} bytes): {type(exc).__name__}: {exc}") from None
