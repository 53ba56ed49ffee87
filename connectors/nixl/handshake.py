"""The side channel: a peer fetches this worker's NIXL agent metadata and KV layout.

The worker owns a `SideChannelServer` (ZMQ ROUTER, one background thread that blocks in
`poll` with a timeout, so it never spins). Each request is one msgpack `HandshakeRequest`;
each reply one `HandshakeResponse` or `HandshakeError`. A malformed or oversized request
gets a `HandshakeError` and is logged and counted (`malformed`); the server keeps
serving. A client that does not read its replies has at most `REPLY_HWM` queued; the
next ones are dropped, never waited for. Peers call
`fetch_remote_layout`, which raises `HandshakeFailed` on an error reply, a timeout, or an
undecodable reply.

Who is answered: a server given its peers' networks (`peers`: `--kv-allowed-peers`, or
loopback without a secret) refuses a request from any other address (the TCP peer's,
not anything the request says), and one given the deployment's handshake key (`key`,
derived from its secret) refuses a request without a proof that its sender holds it
(`handshake_request` makes one; pd/kv_transfer/signing.py `handshake_proof`), or whose
proof was made more than PROOF_WINDOW_S from now. A refused peer gets a `HandshakeError`
saying why, and nothing of this engine's agent: the NIXL metadata (and with it the keys
to read the registered KV memory) goes only to peers. Refusals are logged and counted
(`refused`).

Wire format: both REQ and DEALER clients are served; a reply carries the request's
envelope back (identity, empty delimiter, payload).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import threading
import time
from collections.abc import Callable, Sequence

import zmq

from connectors.nixl.peer_messages import (
    HandshakeError,
    HandshakeReply,
    HandshakeRequest,
    HandshakeResponse,
    MessageDecodeError,
    decode_reply,
    decode_request,
    encode,
)
from pd.kv_transfer.signing import handshake_proof

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 1 << 20  # larger requests get a HandshakeError reply
MAX_WIRE_BYTES = 16 << 20  # ZMQ drops the connection of a peer sending more than this
POLL_INTERVAL_MS = 100  # how long the server thread blocks before checking for close()
REPLY_HWM = 4  # replies queued for one client before its next ones are dropped
PROOF_WINDOW_S = 300.0  # a proof is taken this long either side of its time: the deployment's clocks agree within it

Responder = Callable[[HandshakeRequest], HandshakeReply]


class HandshakeFailed(Exception):
    """The side channel gave no usable layout: `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _endpoint(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def handshake_request(engine_id: str, compat_hash: str, key: str | None,
                      wall_clock: Callable[[], float] = time.time) -> HandshakeRequest:
    """A request for a peer's layout, proving the deployment's secret by its handshake
    `key` (pd/kv_transfer/signing.py `handshake_key`), if there is one."""
    sent_at = wall_clock()
    proof = handshake_proof(key, engine_id, compat_hash, sent_at) if key else ""
    return HandshakeRequest(engine_id, compat_hash, sent_at, proof)


class SideChannelServer:
    """Serves `respond(request)` on tcp://host:port until `close()`, to `peers` (networks;
    None: any address) that prove the secret by its handshake `key` (None: no proof asked).

    `port=0` binds a free port; `self.port` is the port bound. `respond` runs on the
    server thread; an exception it raises becomes a HandshakeError reply.
    """

    def __init__(self, host: str, port: int, respond: Responder, peers: Sequence[str] | None = None,
                 key: str | None = None, wall_clock: Callable[[], float] = time.time) -> None:
        self._respond = respond
        self._peers = None if peers is None else [ipaddress.ip_network(p, strict=False) for p in peers]
        self._key = key
        self._wall_clock = wall_clock
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_BYTES)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished or full peer raises, not blocks
        self._socket.setsockopt(zmq.SNDHWM, REPLY_HWM)
        if ":" in host:
            self._socket.setsockopt(zmq.IPV6, 1)
        try:
            self._socket.bind(_endpoint(host, port or "*"))
        except zmq.ZMQError:
            self._socket.close()
            self._context.term()
            raise
        endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.host = host
        self.port = int(endpoint.rsplit(":", 1)[1])
        self.malformed = 0  # requests refused as malformed or oversized
        self.refused = 0  # requests refused as not from a peer (its address, or no proof of the secret)
        self._stop = threading.Event()
        # The socket is used only by the thread from here on (ZMQ sockets are not thread-safe;
        # starting the thread is the memory barrier that hands it over).
        self._thread = threading.Thread(target=self._serve, name=f"side-channel:{self.port}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and release the port; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self._context.term()

    def __enter__(self) -> SideChannelServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if self._socket.poll(POLL_INTERVAL_MS, zmq.POLLIN):
                    try:
                        self._serve_one()
                    except Exception:  # keep serving whatever one request did
                        logger.exception("side channel: serving a request failed")
        finally:
            self._socket.close()

    def _serve_one(self) -> None:
        frames = self._socket.recv_multipart(copy=False)
        reply = self._reply_to([frame.bytes for frame in frames[1:]], frames[-1].get("Peer-Address"))
        try:
            self._socket.send_multipart([frames[0].bytes, b"", encode(reply)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the client left before its reply, or does not read them
            logger.info("side channel: could not reply to a client: %s", exc)

    def _reply_to(self, body: list[bytes], sender: str) -> HandshakeReply:
        """The reply to one request; `body` is the message after the ROUTER identity,
        `sender` the address it came from."""
        if body and body[0] == b"":  # REQ / DEALER-with-delimiter envelope
            body = body[1:]
        size = sum(len(frame) for frame in body)
        if size > MAX_REQUEST_BYTES:
            return self._refuse(f"handshake request of {size} bytes exceeds {MAX_REQUEST_BYTES}")
        if len(body) != 1:
            return self._refuse(f"malformed handshake request: expected 1 frame, got {len(body)}")
        try:
            request = decode_request(body[0])
        except MessageDecodeError as exc:
            return self._refuse(f"malformed handshake request: {exc}")
        stranger = self._stranger(request, sender)
        if stranger is not None:
            self.refused += 1
            logger.warning("side channel: refused %r from %s: %s", request.engine_id, sender, stranger)
            return HandshakeError(stranger)
        try:
            reply = self._respond(request)
        except Exception as exc:  # a bug in respond must not stop the side channel
            logger.exception("side channel: responding to %r failed", request.engine_id)
            return HandshakeError(f"internal error answering the handshake: {exc}")
        if not isinstance(reply, (HandshakeResponse, HandshakeError)):
            logger.error("side channel: respond returned %s", type(reply).__name__)
            return HandshakeError("internal error answering the handshake")
        return reply

    def _stranger(self, request: HandshakeRequest, sender: str) -> str | None:
        """Why `request`, from `sender`, is not a peer's; None if it is."""
        if self._peers is not None:
            try:
                address = ipaddress.ip_address(sender.split("%")[0])  # an IPv6 zone, if any, aside
            except ValueError:
                return f"the side channel cannot tell where the request came from ({sender!r})"
            if not any(address in network for network in self._peers):
                return f"{address} is not an allowed peer of this server (--kv-allowed-peers)"
        if self._key is not None:
            expected = handshake_proof(self._key, request.engine_id, request.compat_hash, request.sent_at)
            if not hmac.compare_digest(request.proof.encode(), expected.encode()):
                return "the handshake does not prove the deployment's transfer secret"
            if not abs(self._wall_clock() - request.sent_at) <= PROOF_WINDOW_S:  # NaN too
                return f"the handshake's proof was made more than {PROOF_WINDOW_S:g} s from this server's clock"
        return None

    def _refuse(self, reason: str) -> HandshakeError:
        self.malformed += 1
        logger.warning("side channel: %s", reason)
        return HandshakeError(reason)


def fetch_remote_layout(host: str, port: int, request: HandshakeRequest, timeout_s: float) -> HandshakeResponse:
    """Ask the side channel at host:port; raises HandshakeFailed on an error reply, no
    reply within `timeout_s`, or a reply that does not decode."""
    endpoint = _endpoint(host, port)
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_BYTES)
    if ":" in host:
        socket.setsockopt(zmq.IPV6, 1)
    try:
        socket.connect(endpoint)
        socket.send_multipart([b"", encode(request)])
        if not socket.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
            raise HandshakeFailed(f"no handshake reply from {endpoint} within {timeout_s:g} s")
        frames = socket.recv_multipart()
    finally:
        socket.close()
        context.term()
    return _response_from(frames, endpoint)


def _response_from(frames: list[bytes], endpoint: str) -> HandshakeResponse:
    try:
        reply = decode_reply(frames[-1])
    except MessageDecodeError as exc:
        raise HandshakeFailed(f"undecodable handshake reply from {endpoint}: {exc}") from None
    if isinstance(reply, HandshakeError):
        raise HandshakeFailed(f"{endpoint} refused the handshake: {reply.reason}")
    return reply
