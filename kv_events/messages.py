"""The KV events on the wire (see the package's docstring): msgpack-encoded msgspec
structs, decoded into these types and checked once where they are received."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

BlockHash = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]  # a sha256 digest
MAX_BLOCKS = 1 << 22  # blocks one event may name
Hashes = Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_BLOCKS)]
Group = Annotated[int, msgspec.Meta(ge=0, lt=1024)]
Medium = Literal["device", "host", "disk"]  # where a block is held: the KV cache itself, or an offload tier


class BlockStored(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=True):
    """Consecutive full blocks of KV cache group `group` entered the prefix cache:
    `block_hashes` in order, the first one's parent `parent_hash` (None: it is block 0),
    covering `token_count` tokens, in `medium` (the KV cache, or an offload tier)."""

    block_hashes: Hashes
    parent_hash: BlockHash | None
    token_count: Annotated[int, msgspec.Meta(ge=0, lt=2**40)]
    group: Group
    medium: Medium = "device"


class BlockRemoved(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=True):
    """These blocks of group `group` left `medium` (evicted for new ones)."""

    block_hashes: Hashes
    group: Group
    medium: Medium = "device"


class AllBlocksCleared(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=True):
    """Every block cached in the KV cache itself is gone (offload tiers keep theirs)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One engine step's events, number `seq` (from 1) of engine `engine_id`. A replay's
    `snapshot` batch holds every block cached at `seq`, to replace what was held."""

    engine_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    seq: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
    events: Annotated[list[KVEvent], msgspec.Meta(max_length=MAX_BLOCKS)]
    snapshot: bool = False


class ReplayRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Ask for the batches from number `start_seq` on."""

    start_seq: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]


class ReplayReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The batches asked for (or one snapshot batch), oldest first."""

    batches: list[EventBatch]


class MalformedMessage(ValueError):
    """Bytes that are not a message of the type expected (whatever the decoder raised:
    msgspec's DecodeError and ValidationError, but also UnicodeDecodeError for a string
    that is not UTF-8, and anything else a decoder may raise)."""


_encoder = msgspec.msgpack.Encoder()
batch_decoder = msgspec.msgpack.Decoder(EventBatch)
replay_request_decoder = msgspec.msgpack.Decoder(ReplayRequest)
replay_reply_decoder = msgspec.msgpack.Decoder(ReplayReply)


def encode(message: EventBatch | ReplayRequest | ReplayReply) -> bytes:
    return _encoder.encode(message)


def decode(decoder: msgspec.msgpack.Decoder, raw: bytes) -> Any:
    """`decoder.decode(raw)`; MalformedMessage for any failure to decode."""
    try:
        return decoder.decode(raw)
    except Exception as exc:  # not one type: msgspec raises UnicodeDecodeError too
        raise MalformedMessage(f"{type(exc).__name__}: {exc}") from None
