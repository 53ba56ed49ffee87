"""Tensor-parallel ranks on other nodes joining their engine: the engine's listener
(`RankListener`, open only while it waits for them) and a rank's side (`join`).

Both ends prove they hold the deployment's secret before either reads anything else:
the engine sends a fresh nonce, the rank answers with its rank, a nonce of its own and
an HMAC over the engine's; the engine answers with an HMAC over the rank's. A connection
that fails any of it (wrong secret, a rank not awaited or already joined, garbage,
silence past `JOIN_TIMEOUT_S`) is closed and counted; the engine goes on waiting.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from collections.abc import Callable

from pd.worker.rank_channel import (JOIN_FROM_ENGINE, JOIN_FROM_RANK, MAX_FRAME, MAX_JOIN_FRAME, NONCE_BYTES,
                                    Challenge, ChannelError, Hello, RankChannel, Welcome, mac, new_nonce)

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0  # a joining connection proves itself within this, or is closed
MAX_PENDING = 16  # connections proving themselves at once; more are closed at accept
RANK_ROLE, ENGINE_ROLE = b"pd-tp-rank", b"pd-tp-engine"


class RankListener:
    """Accepts the ranks in `ranks` (each once) until closed."""

    def __init__(self, host: str, port: int, secret: str, ranks: set[int]) -> None:
        self.secret = secret
        self.awaited = set(ranks)
        self.joined: dict[int, RankChannel] = {}
        self.refused = 0  # connections closed without joining
        self.lock = threading.Lock()
        self.pending = threading.BoundedSemaphore(MAX_PENDING)
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
            if not self.pending.acquire(blocking=False):
                self._refuse(conn, peer, "too many connections proving themselves at once")
                continue
            threading.Thread(target=self._admit, args=(conn, peer), daemon=True).start()

    def _admit(self, conn: socket.socket, peer: tuple) -> None:
        channel = RankChannel(conn, MAX_JOIN_FRAME)
        try:
            nonce = new_nonce()
            channel.send(Challenge(nonce))
            hello = channel.recv(JOIN_FROM_RANK, JOIN_TIMEOUT_S)
            if len(hello.nonce) != NONCE_BYTES or not 0 <= hello.rank < 1 << 31:
                raise ChannelError("a malformed hello")
            if not hmac.compare_digest(hello.mac, mac(self.secret, RANK_ROLE, nonce, hello.rank)):
                raise ChannelError("it does not hold the deployment's secret")
            with self.lock:
                if hello.rank not in self.awaited or hello.rank in self.joined or self.closed:
                    raise ChannelError(f"rank {hello.rank} is not awaited (or already joined)")
                channel.send(Welcome(mac(self.secret, ENGINE_ROLE, hello.nonce, hello.rank)))
                channel.max_frame = MAX_FRAME
                self.joined[hello.rank] = channel
            logger.info("tensor-parallel rank %d joined from %s:%d", hello.rank, *peer[:2])
        except ChannelError as exc:
            self._refuse(conn, peer, str(exc))
        finally:
            self.pending.release()

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
    """Connect to the engine at host:port as `rank` (retrying while it is not yet
    listening, up to `timeout` seconds) and prove the secret both ways."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=JOIN_TIMEOUT_S)
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise ChannelError(f"cannot reach the engine at {host}:{port}: {exc}") from exc
            time.sleep(0.5)
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # an engine whose node vanished ends the rank
    channel = RankChannel(sock, MAX_JOIN_FRAME)
    try:
        challenge = channel.recv(JOIN_FROM_ENGINE, JOIN_TIMEOUT_S)
        if not isinstance(challenge, Challenge):
            raise ChannelError("the engine did not start with a challenge")
        nonce = new_nonce()
        channel.send(Hello(rank, nonce, mac(secret, RANK_ROLE, challenge.nonce, rank)))
        welcome = channel.recv(JOIN_FROM_ENGINE, JOIN_TIMEOUT_S)
    except ChannelError as exc:
        channel.close()
        raise ChannelError(f"the engine at {host}:{port} refused rank {rank} (wrong secret, a rank it does not "
                           f"await, or one already joined): {exc}") from exc
    if not isinstance(welcome, Welcome) or not hmac.compare_digest(
            welcome.mac, mac(secret, ENGINE_ROLE, nonce, rank)):
        channel.close()
        raise ChannelError(f"the server at {host}:{port} does not hold the deployment's secret")
    channel.max_frame = MAX_FRAME
    return channel
