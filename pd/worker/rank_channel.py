"""What an engine (rank 0) and each of its other tensor-parallel ranks say to each other,
and how: length-prefixed msgpack frames over a stream socket, every message one msgspec
schema (nothing is unpickled, so the same channel serves a rank on another node).

A rank the engine starts on its own node gets one end of a socket pair. A rank on
another node (`pd tp-rank`) connects to the engine's join listener and both prove they
hold the deployment's secret (HMAC over a fresh nonce each way) before anything else
is read: a connection that cannot, or sends anything else, is closed and the engine
keeps waiting for its ranks.

Per rank: the engine sends `Setup`, the rank answers `Ready` (or `Failed`); then for
every step the engine sends `Step` and the rank answers `StepDone`; `Stop` ends it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import select
import socket
import struct
import time
from pathlib import Path

import msgspec
import numpy as np

from pd.config import EngineConfig
from pd.contracts.connector_api import ConnectorContext, KVConnectorOutput
from pd.contracts.outputs import SchedulerOutput

HEADER = struct.Struct("!I")
MAX_FRAME = 1 << 30  # a step names every new request's tokens: large, but bounded
MAX_JOIN_FRAME = 4096  # before a peer has proven the secret
NONCE_BYTES = 32
ARRAY_DTYPES = frozenset({"int32"})  # what crosses in a step: grammar bitmask rows


class ChannelError(Exception):
    """The other end is gone, timed out, or sent what is not a message of this channel."""


class Challenge(msgspec.Struct, frozen=True, tag="challenge"):
    nonce: bytes


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    rank: int
    nonce: bytes
    mac: bytes  # over the engine's nonce and `rank`


class Welcome(msgspec.Struct, frozen=True, tag="welcome"):
    mac: bytes  # over the rank's nonce and its rank


class Refused(msgspec.Struct, frozen=True, tag="refused"):
    reason: str  # what in the hello was refused: the rank stops trying


class StoreAddress(msgspec.Struct, frozen=True):
    """Where the ranks' `torch.distributed` store is: a TCP store (`host`, `port`) when
    a rank is on another node, else a file store (`path`) that opens no port."""

    host: str = ""
    port: int = 0
    path: str = ""


class Setup(msgspec.Struct, frozen=True, tag="setup"):
    config: EngineConfig
    rank: int
    store: StoreAddress
    context: ConnectorContext


class Step(msgspec.Struct, frozen=True, tag="step"):
    output: SchedulerOutput  # its connector metadata travels in `metadata` (the connector's own type)
    metadata: msgspec.Raw


class Stop(msgspec.Struct, frozen=True, tag="stop"):
    pass


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    info: msgspec.Raw  # the connector's `rank_info`, of its `rank_info_type`
    kv_bytes: int


class Failed(msgspec.Struct, frozen=True, tag="failed"):
    reason: str


class StepDone(msgspec.Struct, frozen=True, tag="step_done"):
    output: KVConnectorOutput


def _enc_hook(obj: object) -> object:
    if isinstance(obj, np.ndarray):
        return (str(obj.dtype), list(obj.shape), obj.tobytes())
    if isinstance(obj, Path):
        return str(obj)
    raise NotImplementedError(f"{type(obj).__name__} cannot cross the rank channel")


def _dec_hook(kind: type, obj: object) -> object:
    if kind is Path and isinstance(obj, str):
        return Path(obj)
    if kind is np.ndarray:
        dtype, shape, data = msgspec.convert(obj, tuple[str, list[int], bytes])
        if dtype not in ARRAY_DTYPES or any(n < 0 for n in shape):
            raise ValueError(f"an array of {dtype} {shape} is not one a step carries")
        array = np.frombuffer(data, dtype=dtype)
        return array.reshape(shape).copy()  # a size that does not match the shape raises
    raise NotImplementedError(f"{kind} cannot cross the rank channel")


ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
TO_RANK = msgspec.msgpack.Decoder(Setup | Step | Stop, dec_hook=_dec_hook)
FROM_RANK = msgspec.msgpack.Decoder(Ready | Failed | StepDone, dec_hook=_dec_hook)
JOIN_FROM_RANK = msgspec.msgpack.Decoder(Hello)
JOIN_FROM_ENGINE = msgspec.msgpack.Decoder(Challenge | Welcome | Refused)


def encode(obj: object) -> msgspec.Raw:
    """`obj` encoded on its own (a connector's metadata or rank info)."""
    return msgspec.Raw(ENCODER.encode(obj))


def decode(raw: msgspec.Raw, kind: type) -> object:
    """What `encode` made of a `kind`; ChannelError if it is not one."""
    try:
        return msgspec.msgpack.decode(raw, type=kind, dec_hook=_dec_hook)
    except Exception as exc:  # any decode or validation failure: the peer sent garbage
        raise ChannelError(f"not a {kind.__name__}: {exc}") from exc


def mac(secret: str, role: bytes, nonce: bytes, rank: int) -> bytes:
    return hmac.new(secret.encode(), role + nonce + rank.to_bytes(4, "big"), hashlib.sha256).digest()


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


class RankChannel:
    """One end of an engine ↔ rank connection."""

    def __init__(self, sock: socket.socket, max_frame: int = MAX_FRAME) -> None:
        self.sock = sock
        self.max_frame = max_frame

    def send(self, message: msgspec.Struct) -> None:
        self.send_frame(ENCODER.encode(message))

    def send_frame(self, body: bytes) -> None:
        """A message already encoded (one step sent to every rank is encoded once)."""
        try:
            self.sock.sendall(HEADER.pack(len(body)) + body)
        except OSError as exc:
            raise ChannelError(f"send failed: {exc}") from exc

    def poll(self, timeout: float) -> bool:
        """Whether something (a frame, or the end of the connection) can be read."""
        try:
            return bool(select.select([self.sock], [], [], max(timeout, 0.0))[0])
        except (OSError, ValueError):  # closed under us
            return True

    def recv(self, decoder: msgspec.msgpack.Decoder, timeout: float | None = None) -> object:
        """The next message, within `timeout` seconds (None: no limit); ChannelError if the
        connection ends, the time runs out, or the frame is not one of `decoder`'s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        (size,) = HEADER.unpack(self._read(HEADER.size, deadline))
        if size > self.max_frame:
            raise ChannelError(f"a frame of {size} bytes (at most {self.max_frame})")
        body = self._read(size, deadline)
        try:
            return decoder.decode(body)
        except Exception as exc:  # any decode or validation failure
            raise ChannelError(f"not a message of this channel: {exc}") from exc

    def _read(self, size: int, deadline: float | None) -> bytes:
        chunks, left = [], size
        while left:
            if deadline is not None and not self.poll(deadline - time.monotonic()):
                raise ChannelError("timed out")
            try:
                chunk = self.sock.recv(min(left, 1 << 20))
            except OSError as exc:
                raise ChannelError(f"receive failed: {exc}") from exc
            if not chunk:
                raise ChannelError("the connection ended")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
