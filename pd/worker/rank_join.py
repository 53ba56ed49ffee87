"""Tensor-parallel ranks on other nodes joining their engine: the engine's listener
(`RankListener`, open only while it waits for them) and a rank's side (`join`).

Both ends prove they hold the deployment's secret before either reads anything else:
the engine sends a fresh nonce, the rank answers with its rank, a nonce of its own and
an HMAC over the engine's; the engine answers with an HMAC over the rank's. A connection
that fails any of it (wrong secret, a rank not awaited or already joined, garbage,
silence past `JOIN_TIMEOUT_S`) is closed and counted; the engine goes on waiting. A hello
refused for what it says (wrong secret, a rank not awaited) is told so (`Refused`): the
rank stops there. Anything else (a connection dropped, a silent engine) the rank retries
until its join timeout, and then says what the last try met.

Connections that have not yet said hello cannot keep a rank out: at most
`MAX_PENDING_PER_ADDRESS` of one address and `MAX_PENDING` in all prove themselves at
once, and a connection past either bound takes the place of the oldest silent one (of
its address, or of all), which is closed. A real rank answers the challenge at once, so
a flood of idle connections only pushes out its own.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pd.worker.rank_channel import (
    JOIN_FROM_ENGINE,
    JOIN_FROM_RANK,
    MAX_FRAME,
    MAX_JOIN_FRAME,
    NONCE_BYTES,
    Challenge,
    ChannelError,
    Hello,
    RankChannel,
    Refused,
    Welcome,
    mac,
    new_nonce,
)

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 3.0  # a joining connection says hello within this, or is closed
MAX_PENDING = 64  # connections proving themselves at once
MAX_PENDING_PER_ADDRESS = 8  # of them from one address
RETRY_S = 0.5  # a rank's wait between tries
RANK_ROLE, ENGINE_ROLE = b"pd-tp-rank", b"pd-tp-engine"


@dataclass
class _Proving:
    """A connection the listener is hearing out: from which address, whether its hello
    came, and why it was closed under it (None: it was not)."""

    host: str
    heard: bool = False
    dropped: str | None = None


class RankListener:
    """Accepts the ranks in `ranks` (each once) until closed."""

    def __init__(self, host: str, port: int, secret: str, ranks: set[int]) -> None:
        self.secret = secret
        self.awaited = set(ranks)
        self.joined: dict[int, RankChannel] = {}
        self.refused = 0  # connections closed without joining
        self.lock = threading.Lock()
        self.proving: dict[socket.socket, _Proving] = {}  # oldest first
        self.server = socket.create_server((host, port))
        self.port = self.server.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, name="pd-tp-join", daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, peer = self.server.accept()
            except OSError:
                return  # closed
            if not self._make_room(conn, peer[0]):
                self._refuse(conn, peer, "too many connections are proving themselves and none is silent")
                continue
            threading.Thread(target=self._admit, args=(conn, peer), daemon=True).start()

    def _make_room(self, conn: socket.socket, host: str) -> bool:
        """Take `conn` in among the connections proving themselves, closing the oldest
        silent one of its address (or of all) where a bound is reached; False when no
        silent one is left to close."""
        with self.lock:
            crowd = [c for c, p in self.proving.items() if p.host == host]
            if len(crowd) < MAX_PENDING_PER_ADDRESS:
                crowd = list(self.proving) if len(self.proving) >= MAX_PENDING else []
            if crowd:
                silent = next((c for c in crowd if not self.proving[c].heard), None)
                if silent is None:
                    return False
                self.proving[silent].dropped = f"the oldest silent connection, closed for a newer one from {host}"
                with contextlib.suppress(OSError):
                    silent.shutdown(socket.SHUT_RDWR)  # its thread's wait ends now
            self.proving[conn] = _Proving(host)
        return True

    def _admit(self, conn: socket.socket, peer: tuple) -> None:
        channel = RankChannel(conn, MAX_JOIN_FRAME)
        try:
            nonce = new_nonce()
            channel.send(Challenge(nonce))
            hello = channel.recv(JOIN_FROM_RANK, JOIN_TIMEOUT_S)
            with self.lock:
                self.proving[conn].heard = True
            self._welcome(channel, nonce, hello, peer)
        except ChannelError as exc:
            with self.lock:
                dropped = self.proving[conn].dropped
            self._refuse(conn, peer, dropped or str(exc))
        finally:
            with self.lock:
                self.proving.pop(conn, None)

    def _welcome(self, channel: RankChannel, nonce: bytes, hello: Hello, peer: tuple) -> None:
        if len(hello.nonce) != NONCE_BYTES or not 0 <= hello.rank < 1 << 31:
            raise ChannelError("a malformed hello")
        if not hmac.compare_digest(hello.mac, mac(self.secret, RANK_ROLE, nonce, hello.rank)):
            self._tell(channel, "it does not hold the deployment's secret")
        with self.lock:
            if hello.rank not in self.awaited or hello.rank in self.joined or self.closed:
                refusal = f"rank {hello.rank} is not awaited (or already joined)"
            else:
                refusal = None
                channel.send(Welcome(mac(self.secret, ENGINE_ROLE, hello.nonce, hello.rank)))
                channel.max_frame = MAX_FRAME
                self.joined[hello.rank] = channel
        if refusal is not None:
            self._tell(channel, refusal)
        logger.info("tensor-parallel rank %d joined from %s:%d", hello.rank, *peer[:2])

    @staticmethod
    def _tell(channel: RankChannel, why: str) -> None:
        """Refuse a hello for what it said: the rank is told why (it stops trying)."""
        with contextlib.suppress(ChannelError):
            channel.send(Refused(why))
        raise ChannelError(why)

    def _refuse(self, conn: socket.socket, peer: tuple, why: str) -> None:
        with self.lock:
            self.refused += 1
        logger.warning("refused a tensor-parallel rank connection from %s:%d: %s", peer[0], peer[1], why)
        conn.close()

    def wait(self, seconds: float, check: Callable[[], None]) -> dict[int, RankChannel]:
        """Every awaited rank's channel, by rank, once all joined; `check` runs while
        waiting (it raises to give up); RuntimeError after `seconds`."""
        deadline = time.monotonic() + seconds
        while True:
            with self.lock:
                if self.awaited <= self.joined.keys():
                    return dict(self.joined)
                missing = sorted(self.awaited - self.joined.keys())
            check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel ranks {missing} did not join within {seconds:.0f} s "
                                   f"(pd tp-rank --join HOST:{self.port} --rank R on their nodes)")
            time.sleep(0.05)

    def close(self) -> None:
        """No more joins; channels already joined stay open."""
        with self.lock:
            self.closed = True
        self.server.close()


def join(host: str, port: int, rank: int, secret: str, timeout: float) -> RankChannel:
    """Connect to the engine at host:port as `rank` and prove the secret both ways,
    trying again (up to `timeout` seconds) while it is not listening yet or a try fails
    without a refusal; ChannelError saying what the last try met."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _try_join(host, port, rank, secret)
        except _Retry as exc:
            if time.monotonic() > deadline:
                raise ChannelError(f"rank {rank} could not join the engine at {host}:{port} within {timeout:.0f} s; "
                                   f"the last try: {exc}") from None
            logger.warning("rank %d joining %s:%d: %s; trying again", rank, host, port, exc)
            time.sleep(RETRY_S)


class _Retry(Exception):
    """A try at joining that failed for no reason of the rank's own: try again."""


def _try_join(host: str, port: int, rank: int, secret: str) -> RankChannel:
    try:
        sock = socket.create_connection((host, port), timeout=JOIN_TIMEOUT_S)
    except OSError as exc:
        raise _Retry(f"cannot reach it: {exc}") from exc
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # an engine whose node vanished ends the rank
    channel = RankChannel(sock, MAX_JOIN_FRAME)
    try:
        challenge = channel.recv(JOIN_FROM_ENGINE, JOIN_TIMEOUT_S)
        if not isinstance(challenge, Challenge):
            raise ChannelError("the engine did not start with a challenge")
        nonce = new_nonce()
        channel.send(Hello(rank, nonce, mac(secret, RANK_ROLE, challenge.nonce, rank)))
        answer = channel.recv(JOIN_FROM_ENGINE, JOIN_TIMEOUT_S)
    except ChannelError as exc:
        channel.close()
        raise _Retry(f"the connection failed before a welcome: {exc}") from exc
    if isinstance(answer, Refused):
        channel.close()
        raise ChannelError(f"the engine at {host}:{port} refused rank {rank}: {answer.reason}")
    if not isinstance(answer, Welcome) or not hmac.compare_digest(answer.mac, mac(secret, ENGINE_ROLE, nonce, rank)):
        channel.close()
        raise ChannelError(f"the server at {host}:{port} does not hold the deployment's secret")
    channel.max_frame = MAX_FRAME
    return channel
