"""The NIXL connector's worker half: moves the blocks the scheduler half decided on.

It owns one NIXL agent (progress thread off; transfers progress when `get_finished`
polls, once per engine step) with the whole KV cache registered once, and the side
channel on which peers fetch this engine's agent metadata and layout.

- D: for each request to receive, handshake with P once per peer (side channel, on a
  background thread: `peers.py`; the request waits, the step goes on), then post one
  READ of all its runs and, once it is DONE, a second READ of P's lease word for the
  request (leases.py). The blocks are the request's only if the word still holds the
  token P named: otherwise P freed them (its lease ended, or they were released)
  before the data READ ended, and they may hold another request's KV. Then D tells P
  it is done (a read-done notification: P frees the blocks). Neither READ carries a
  notification, so both complete on D's polling alone, whether P polls or not (a READ
  with one is DONE only after P polled); a P without lease words gets the notification
  on its one READ. A read that fails, finds
  the word changed, ends after P's lease, or is still under way after `read_timeout_s`
  (it is then cancelled, and P told to free) is reported in `failed_recving` (the
  scheduler then recomputes or fails the request). A read whose parameters were not
  signed with the deployment's secret (or name no lease word) is reported in
  `unverified` as well: it may serve its request, never the prefix cache.
- P: blocks kept for a reader are released (`finished_sending`) on its read-done
  notification, on its reject, on a release from the scheduler half, or when the
  lease expires, and their lease word reads 0 from then on; a KeepAlive from D (the
  request waits in D's queue) extends the lease to its full length from the
  KeepAlive's arrival.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from connectors.nixl.handshake import SideChannelServer
from connectors.nixl.leases import LeaseTable
from pd.kv_cache.canonical import CanonicalKVCaches
from pd.kv_transfer.params import RemotePrefillParams
from pd.scheduling.connector_api import KVConnectorOutput, KVConnectorWorker
from connectors.nixl.peer_messages import (HandshakeError, HandshakeRequest, HandshakeResponse, KeepAlive,
                                      NotifDecodeError, ReadDone, Reject, decode_notif, encode_notif)
from connectors.nixl.peers import PeerHandshakes
from connectors.nixl.scheduler import NixlConnectorMetadata, ReqToRecv
from connectors.nixl.stats import TransferStats

logger = logging.getLogger(__name__)

LATE_READ_GRACE_S = 10.0  # P polls this long after a lease expired, so a read already posted ends
# The sender polls this long after a notification: without a progress thread UCX sends it
# (and wires up a new peer's endpoint) only while the sender's agent is polled.
NOTIF_FLUSH_S = 5.0


@dataclass
class _Loading:
    request: ReqToRecv
    handle: object
    started: float
    num_bytes: int
    num_descriptors: int
    landing: int | None = None  # the lease word its verifying read lands in, once posted


@dataclass
class NixlWorkerConfig:
    engine_id: str
    host: str
    side_channel_port: int
    compat_hash: str
    handshake_timeout_s: float = 5.0
    handshake_backoff_s: float = 10.0  # a peer whose handshake failed is not tried again sooner
    lease_seconds: float = 60.0  # P: what a KeepAlive extends a lease to, from its arrival
    read_timeout_s: float = 30.0  # D: a read still under way after this long is cancelled and fails
    ucx_transports: str = "auto"  # UCX_TLS, or auto (ucx.configure_ucx)
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time


class NixlConnectorWorker(KVConnectorWorker):
    def __init__(self, config: NixlWorkerConfig) -> None:
        self.config = config
        self.transport = None
        self.side_channel = None
        self.peers: set[str] = set()
        self.handshakes = PeerHandshakes(HandshakeRequest(config.engine_id, config.compat_hash),
                                         config.handshake_timeout_s, config.handshake_backoff_s, config.clock)
        # engine id -> what waits for its handshake: (do it, fail it with why)
        self.waiting_for_peer: dict[str, list[tuple[Callable[[], None], Callable[[str], None]]]] = {}
        self.loading: dict[str, _Loading] = {}
        self.failed: dict[str, str] = {}  # failed before a read could be posted -> why
        self.deadlines: dict[str, float] = {}  # P: request id -> monotonic end of its lease
        self.leases: LeaseTable | None = None  # lease words (P's slots, D's landing words), made with the transport
        self.released: set[str] = set()  # P: leases ended by a release, reported next poll
        self._poll_until = 0.0  # keep progressing NIXL until then (a late read; a notification on its way)
        self.stats = TransferStats()

    # --- set-up -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: CanonicalKVCaches) -> None:
        from connectors.nixl.transport import NixlTransport  # imports nixl: only when used
        from connectors.nixl.ucx import configure_ucx

        configure_ucx(self.config.host, self.config.ucx_transports)
        self.leases = LeaseTable(kv_caches.tensors[0].num_blocks)  # a held request holds a block at least
        self.transport = NixlTransport(self.config.engine_id, kv_caches, lease_words=self.leases.words)
        self.side_channel = SideChannelServer(self.config.host, self.config.side_channel_port, self._respond)

    @property
    def side_channel_port(self) -> int:
        """The port bound (the configured one, or a free one when it was 0)."""
        return self.side_channel.port

    def _respond(self, request):
        if request.compat_hash != self.config.compat_hash:
            return HandshakeError(f"incompatible KV layout: peer {request.engine_id!r} has "
                                  f"{request.compat_hash[:12]}, this engine {self.config.compat_hash[:12]} "
                                  f"(model, dtype, block size, layout or KV cache groups differ)")
        return HandshakeResponse(self.transport.agent_metadata(), self.transport.local_layout(self.config.compat_hash))

    def _when_peer_ready(self, remote: RemotePrefillParams, action: Callable[[], None],
                         fail: Callable[[str], None]) -> None:
        """Run `action` once this engine knows the peer (now, or after its handshake);
        `fail(why)` instead if the handshake fails or failed a moment ago."""
        if remote.remote_engine_id in self.peers:
            action()
        elif (why := self.handshakes.failed_recently(remote.remote_engine_id)) is not None:
            fail(why)
        elif (why := self.handshakes.start(remote.remote_engine_id, remote.remote_host,
                                           remote.remote_port)) is not None:
            fail(why)
        else:
            self.waiting_for_peer.setdefault(remote.remote_engine_id, []).append((action, fail))

    def _finish_handshakes(self) -> None:
        """Load the agents of peers whose handshake ended; run or fail what waited."""
        for engine_id, outcome, seconds in self.handshakes.completed():
            if isinstance(outcome, HandshakeResponse):
                try:
                    if outcome.layout.engine_id != engine_id:
                        raise ValueError(f"the side channel there belongs to engine {outcome.layout.engine_id!r}, "
                                         f"not {engine_id!r}")
                    self.transport.add_peer(outcome)
                    self.peers.add(engine_id)
                except Exception as exc:
                    outcome = exc
                    self.handshakes.mark_failed(engine_id, str(exc))
            if engine_id in self.peers:
                self.stats.handshakes += 1
                self.stats.handshake_time.observe(seconds)
            else:
                self.stats.handshake_failures += 1
            for action, fail in self.waiting_for_peer.pop(engine_id, []):
                action() if engine_id in self.peers else fail(str(outcome))

    # --- every step ---------------------------------------------------------------
    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        for send in metadata.reqs_to_send:
            self.deadlines[send.request_id] = send.deadline
        for req_id in metadata.reqs_to_release:
            if req_id in self.deadlines:
                self._end_lease(req_id)
                self.released.add(req_id)
                self.stats.released += 1
        for recv in metadata.reqs_to_recv:
            self._start_read(recv)
        for remote, reason in metadata.reqs_to_reject:
            self._reject(remote, reason)
        for remote in metadata.reqs_to_keep_alive:
            self._notify(remote, KeepAlive(remote.remote_request_id))

    def _start_read(self, recv: ReqToRecv) -> None:
        self._when_peer_ready(recv.remote, lambda: self._post_read(recv), lambda why: self._fail_read(recv, why))

    def _post_read(self, recv: ReqToRecv) -> None:
        """The data READ; its read-done notification rides on it only when there is no
        lease word to check after it."""
        posting = self.config.clock()
        done = b"" if recv.remote.lease_token is not None else encode_notif(ReadDone(recv.remote.remote_request_id))
        try:
            handle = self.transport.start_read(recv.remote.remote_engine_id, recv.local_block_ids,
                                               recv.remote_block_ids, done)
        except Exception as exc:  # any transport failure fails this request only
            self._fail_read(recv, str(exc))
            return
        self.stats.post_time.observe(self.config.clock() - posting)
        self.loading[recv.request_id] = _Loading(recv, handle, self.config.clock(),
                                                 handle.num_bytes, handle.num_descriptors)

    def _post_check(self, loading: _Loading) -> str | None:
        """After the data READ: the READ of P's lease word; why it could not be posted, or None."""
        remote = loading.request.remote
        try:
            landing = self.leases.take_landing()
        except RuntimeError as exc:
            return str(exc)
        try:
            loading.handle = self.transport.start_word_read(remote.remote_engine_id, remote.lease_slot, landing)
        except Exception as exc:
            self.leases.landed(landing)
            return f"its lease word could not be read: {exc}"
        loading.landing = landing
        return None

    def _fail_read(self, recv: ReqToRecv, why: str) -> None:
        logger.warning("KV read for %s from %s failed to start: %s", recv.request_id, recv.remote.remote_engine_id, why)
        where = f"{recv.remote.remote_host}:{recv.remote.remote_port}"
        self.failed[recv.request_id] = f"the read from {where} could not start: {why}"
        self.stats.failures += 1

    def _reject(self, remote: RemotePrefillParams, reason: str) -> None:
        self._notify(remote, Reject(remote.remote_request_id, reason))

    def _notify(self, remote: RemotePrefillParams, notif: ReadDone | Reject | KeepAlive) -> None:
        """Send P a notification once it is a known peer; if it cannot be reached, its
        lease decides (for a Reject: the blocks are freed at its end)."""
        def send() -> None:
            try:
                self.transport.send_notif(remote.remote_engine_id, encode_notif(notif))
            except Exception as exc:
                unreachable(str(exc))
                return
            self._poll_for(NOTIF_FLUSH_S)

        def unreachable(why: str) -> None:
            logger.info("could not send %s to %s: %s", notif, remote.remote_engine_id, why)
            self.stats.failed_notifications += 1

        self._when_peer_ready(remote, send, unreachable)

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        self._finish_handshakes()
        output = KVConnectorOutput(finished_sending=self.released, failed_recving=self.failed)
        self.failed, self.released = {}, set()
        self._poll_reads(output)
        self._read_notifs(output)
        self._expire_leases(output)
        return output

    def _poll_reads(self, output: KVConnectorOutput) -> None:
        for req_id, loading in list(self.loading.items()):
            state = self.transport.poll(loading.handle)
            if state == "PROC" and self.config.clock() - loading.started >= self.config.read_timeout_s:
                if not self.transport.cancel(loading.handle):
                    continue  # NIXL cannot stop it yet: the blocks stay this read's until it can
                state = "TIMEOUT"
            if state == "DONE" and loading.landing is None and loading.request.remote.lease_token is not None:
                why = self._post_check(loading)  # the data moved: now the lease word
                if why is None:
                    continue
                state = f"ERR: {why}"
            if state != "PROC":
                del self.loading[req_id]
                self._read_ended(loading, state, output)

    def _read_ended(self, loading: _Loading, state: str, output: KVConnectorOutput) -> None:
        """Report a read whose READs are final: received (verified or not) or failed."""
        req_id, remote = loading.request.request_id, loading.request.remote
        word = self.leases.landed(loading.landing) if loading.landing is not None else None
        lease = remote.lease_expires_at
        if state == "DONE" and word is not None and word != remote.lease_token:
            why = "found its blocks freed by the prefill server before the read ended (released, or its lease ended)"
        elif state == "DONE" and lease is not None and self.config.wall_clock() >= lease:
            why = "ended after the prefill server's lease"
        elif state == "DONE":
            output.finished_recving.add(req_id)
            if word is not None:  # checked: P may free the blocks now
                self._notify(remote, ReadDone(remote.remote_request_id))
            if word is None or not loading.request.trusted:
                output.unverified.add(req_id)
            self.stats.read_done(self.config.clock() - loading.started, loading.num_bytes, loading.num_descriptors)
            return
        else:
            why = {"ERR": "failed in transfer", "TIMEOUT": f"was still under way after "
                   f"{self.config.read_timeout_s:g} s"}.get(state, state.removeprefix("ERR: "))
            self._reject(remote, f"the read {why}")  # nothing retries it: P frees its blocks
        logger.warning("KV read for %s from %s %s", req_id, remote.remote_engine_id, why)
        output.failed_recving[req_id] = f"the read from {remote.remote_engine_id} {why}"
        self.stats.failures += 1

    def _read_notifs(self, output: KVConnectorOutput) -> None:
        for peer, payloads in self.transport.get_notifs().items():
            for payload in payloads:
                try:
                    notif = decode_notif(payload)
                except NotifDecodeError as exc:
                    logger.warning("ignoring a malformed notification from %s: %s", peer, exc)
                    self.stats.malformed_notifications += 1
                    continue
                if notif.request_id not in self.deadlines:
                    continue
                if isinstance(notif, KeepAlive):
                    deadline = self.config.clock() + self.config.lease_seconds
                    self.deadlines[notif.request_id] = max(self.deadlines[notif.request_id], deadline)
                    self.stats.keep_alives_received += 1
                    continue
                self._end_lease(notif.request_id)
                output.finished_sending.add(notif.request_id)
                self.stats.rejects_received += isinstance(notif, Reject)

    def _expire_leases(self, output: KVConnectorOutput) -> None:
        now = self.config.clock()
        for req_id, deadline in list(self.deadlines.items()):
            if now >= deadline:
                logger.warning("lease of %s expired before a decode server read it: freeing its blocks", req_id)
                self._poll_for(LATE_READ_GRACE_S)
                self._end_lease(req_id)
                output.finished_sending.add(req_id)
                self.stats.leases_expired += 1

    def _end_lease(self, req_id: str) -> None:
        """The request's blocks are to be freed: first its lease word reads 0, so a reader
        that checks it after its read knows they may no longer be the request's."""
        del self.deadlines[req_id]
        self.leases.release(req_id)

    def _poll_for(self, seconds: float) -> None:
        self._poll_until = max(self._poll_until, self.config.clock() + seconds)

    @property
    def wants_polling(self) -> bool:
        """Reads, handshakes and leases in progress, and for a while after a lease expired:
        a decode server may still be reading, and without a progress thread its read
        moves only while both sides poll (it then ends, as a failure, on D); and for a
        while after a notification was sent, which moves only while the sender polls."""
        busy = self.deadlines or self.loading or self.handshakes.num_pending or self.waiting_for_peer
        return bool(busy) or self.config.clock() < self._poll_until

    def malformed_messages(self) -> dict[str, int]:
        return {"nixl_notification": self.stats.malformed_notifications,
                "side_channel": self.side_channel.malformed if self.side_channel is not None else 0}

    @property
    def num_requests_held(self) -> int:
        return len(self.deadlines)

    def shutdown(self) -> None:
        self.handshakes.close()
        if self.side_channel is not None:
            self.side_channel.close()
        if self.transport is not None:
            self.transport.close()
