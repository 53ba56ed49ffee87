"""P's part of a read: the requests whose blocks are kept for a decode server (rank 0).

A request is held from the step its prefill ends (`hold`, with its lease's deadline)
until D's read-done notification or Reject arrives, the scheduler half releases it, or
its lease expires; each of these ends it once, and from then on its lease word reads 0
(`LeaseTable.release`), so that a reader checking the word after its read knows the
blocks may no longer be the request's. A KeepAlive from D (the request waits in D's
queue) extends the lease to its full length from the KeepAlive's arrival. A request
ended is reported in `finished_sending` (the scheduler frees its blocks).

Notifications are taken only from the agents of peers this server's side channel
answered (`peers`, an `Answered` the worker fills): one from any other agent (a host that
is not a peer and yet reached this agent) ends or extends nothing, and is counted
(`stranger_notifications`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from connectors.nixl.leases import LeaseTable
from connectors.nixl.peer_messages import KeepAlive, NotifDecodeError, Reject, decode_notif
from connectors.nixl.stats import TransferStats
from pd.contracts.connector_api import KVConnectorOutput

logger = logging.getLogger(__name__)

LATE_READ_GRACE_S = 10.0  # P polls this long after a lease expired, so a read already posted ends
MAX_ANSWERED = 4096  # peer agents remembered as answered (a fleet's decode ranks, restarts included)


class Answered:
    """The agents a side channel answered, at most `limit`: past it, the one heard from
    least recently is forgotten (an engine long gone). Noted by the side channel's thread
    and the engine's, under a lock."""

    def __init__(self, limit: int = MAX_ANSWERED) -> None:
        self.limit = limit
        self._agents: dict[str, None] = {}  # least recently heard from first
        self._lock = threading.Lock()

    def __contains__(self, agent: object) -> bool:
        return agent in self._agents

    def note(self, agent: str) -> None:
        """`agent` was answered, or heard from: remembered longest."""
        with self._lock:
            self._agents.pop(agent, None)
            self._agents[agent] = None
            if len(self._agents) > self.limit:
                del self._agents[next(iter(self._agents))]


class Holds:
    def __init__(self, lease_seconds: float, clock: Callable[[], float], stats: TransferStats,
                 poll_for: Callable[[float], None], peers: Answered | None = None) -> None:
        self.lease_seconds = lease_seconds
        self.clock = clock
        self.stats = stats
        self.poll_for = poll_for  # keep the agent progressing this many seconds (a late read)
        self.deadlines: dict[str, float] = {}  # request id -> monotonic end of its lease
        self.leases: LeaseTable | None = None  # the lease words, once the transport registered them
        self.released: set[str] = set()  # ended by a release, reported next poll
        self.peers = peers  # the agents notifications are taken from; None: any

    def __len__(self) -> int:
        return len(self.deadlines)

    def hold(self, req_id: str, deadline: float) -> None:
        self.deadlines[req_id] = deadline

    def release(self, req_id: str) -> None:
        """The scheduler half gave the request up (D never came, or was told no)."""
        if req_id in self.deadlines:
            self._end(req_id)
            self.released.add(req_id)
            self.stats.released += 1

    def update(self, notifs: dict[str, list[bytes]], output: KVConnectorOutput) -> None:
        """This step's notifications, then the leases expired; what ended goes in `output`."""
        output.finished_sending |= self.released
        self.released = set()
        for peer, payloads in notifs.items():
            for payload in payloads:
                self._notified(peer, payload, output)
        now = self.clock()
        for req_id, deadline in list(self.deadlines.items()):
            if now >= deadline:
                logger.warning("lease of %s expired before a decode server read it: freeing its blocks", req_id)
                self.poll_for(LATE_READ_GRACE_S)
                self._end(req_id)
                output.finished_sending.add(req_id)
                self.stats.leases_expired += 1

    def _notified(self, peer: str, payload: bytes, output: KVConnectorOutput) -> None:
        if self.peers is not None:
            if peer not in self.peers:
                logger.warning("ignoring a notification from %r, an agent this server's side channel never answered",
                               peer)
                self.stats.stranger_notifications += 1
                return
            self.peers.note(peer)
        try:
            notif = decode_notif(payload)
        except NotifDecodeError as exc:
            logger.warning("ignoring a malformed notification from %s: %s", peer, exc)
            self.stats.malformed_notifications += 1
            return
        if notif.request_id not in self.deadlines:
            return
        if isinstance(notif, KeepAlive):
            deadline = self.clock() + self.lease_seconds
            self.deadlines[notif.request_id] = max(self.deadlines[notif.request_id], deadline)
            self.stats.keep_alives_received += 1
            return
        self._end(notif.request_id)
        output.finished_sending.add(notif.request_id)
        self.stats.rejects_received += isinstance(notif, Reject)

    def _end(self, req_id: str) -> None:
        del self.deadlines[req_id]
        self.leases.release(req_id)
