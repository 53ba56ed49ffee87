"""The NIXL connector's worker half: moves the blocks the scheduler half decided on.

It owns one NIXL agent (progress thread off; transfers progress when `get_finished`
polls, once per engine step) with the whole KV cache registered once, and the side
channel on which peers fetch this engine's agent metadata and layout.

- D: for each request to receive, handshake with P once per peer (side channel, on a
  background thread: `peers.py`; then its agents are loaded: `peer_agents.py`; the
  request waits, the step goes on), then post one READ of all its runs (one per P rank
  read from) and, once it is DONE, a second READ of P's lease word for the
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
- Tensor parallelism: every rank has a worker half with its own agent (named
  `rank_agent_name(engine id, rank)`) and its own KV memory registered; rank 0's is the
  engine's. P's rank 0 serves every rank's agent and layout on its side channel (ranks
  hand theirs over once built: `rank_info`, `add_ranks`). On D every rank handshakes
  itself and reads, from the P ranks holding heads it holds (the ranks with its own
  heads first), each piece once (`taken`); a rank > 0 reports its share of each request
  (`finished_recving` / `failed_recving`) and rank 0 gathers them (`add_rank_outputs`):
  only when every rank's READs are final does it read the lease word (after every
  rank's data moved) or fail the request, so no block is given up while a rank may
  still write into it. Leases, notifications and KeepAlives are rank 0's alone; a P
  rank > 0 only polls its agent, each step.
- P: blocks kept for a reader are released (`finished_sending`) on its read-done
  notification, on its reject, on a release from the scheduler half, or when the
  lease expires (`holds.py`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from connectors.nixl.digest_book import DigestBook
from connectors.nixl.handshake import SideChannelServer, handshake_request
from connectors.nixl.holds import Answered, Holds
from connectors.nixl.integrity import Integrity
from connectors.nixl.leases import LeaseTable
from connectors.nixl.peer_agents import PeerAgents
from connectors.nixl.peer_messages import (
    HandshakeError,
    HandshakeRequest,
    HandshakeResponse,
    KeepAlive,
    RankAgent,
    ReadDone,
    Reject,
    encode_notif,
    rank_agent_name,
)
from connectors.nixl.peers import PeerHandshakes
from connectors.nixl.scheduler import NixlConnectorMetadata, ReqToRecv
from connectors.nixl.stats import TransferStats
from pd.contracts.connector_api import KVConnectorOutput, KVConnectorWorker
from pd.kv_cache.canonical import CanonicalKVCaches
from pd.kv_transfer.compat import COMPAT_DIFFERS
from pd.kv_transfer.connector_config import ConnectorConfig
from pd.kv_transfer.digests import WHOLE
from pd.kv_transfer.params import RemotePrefillParams

if TYPE_CHECKING:
    from connectors.nixl.transport import TransferHandle

logger = logging.getLogger(__name__)

DIGEST_MISMATCH = "brought bytes that are not what the holder digested"  # a load failure's reason starts so
# The sender polls this long after a notification: without a progress thread UCX sends it
# (and wires up a new peer's endpoint) only while the sender's agent is polled.
NOTIF_FLUSH_S = 5.0


@dataclass
class _Loading:
    request: ReqToRecv
    handles: list[TransferHandle]  # the data READs (one per P rank read from); then the lease word's
    started: float
    num_bytes: int
    num_descriptors: int
    error: str | None = None  # a READ could not be posted: the request fails once the others are final
    notified: bool = False  # the read-done notification rode on the data READ
    outcome: str | None = None  # this rank's data READs are final: "DONE", "ERR", "TIMEOUT" or "ERR: why"
    landing: int | None = None  # the lease word its verifying read lands in, once posted
    units_read: list[tuple[int, list[set]]] = field(default_factory=list)  # (P rank, unit keys read per group)


@dataclass(frozen=True)
class NixlWorkerConfig:
    """A worker half's settings: the engine's transfer settings as a connector sees them
    (`transfer`: side channel, lease, read timeout, UCX transports, digests), with which
    engine and rank it serves and how it treats peers' handshakes."""

    engine_id: str
    compat_hash: str
    transfer: ConnectorConfig
    rank: int = 0  # the tensor-parallel rank whose KV memory this worker moves
    tp_size: int = 1
    handshake_timeout_s: float = 5.0
    handshake_backoff_s: float = 10.0  # a peer whose handshake failed is not tried again sooner
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time


class NixlConnectorWorker(KVConnectorWorker):
    def __init__(self, config: NixlWorkerConfig) -> None:
        self.config = config
        self.transport = None
        self.side_channel = None
        self.agent_name = rank_agent_name(config.engine_id, config.rank)
        self.stats = TransferStats()
        key = config.transfer.handshake_key
        self.peers = PeerAgents(PeerHandshakes(lambda: handshake_request(self.agent_name, config.compat_hash, key),
                                               config.handshake_timeout_s, config.handshake_backoff_s, config.clock),
                                config.rank, self.stats)
        self.rank_agents: list[RankAgent] = []  # rank 0: ranks 1..N-1's agents and layouts
        self.rank_results: dict[str, dict[int, str | None]] = {}  # rank 0: request -> rank -> why it failed
        self.rank_sizes: dict[str, dict[int, tuple[int, int]]] = {}  # rank 0: request -> rank -> (bytes, descriptors)
        self.loading: dict[str, _Loading] = {}
        self.failed: dict[str, str] = {}  # failed before a read could be posted -> why
        self.leases: LeaseTable | None = None  # lease words (P's slots, D's landing words), made with the transport
        self.answered = Answered()  # the agents this side channel answered: their notifications count
        self.holds = Holds(config.transfer.lease_seconds, config.clock, self.stats, self._poll_for, self.answered)  # P
        self.digest_book = DigestBook(config.tp_size) if config.transfer.digest and config.rank == 0 else None  # P
        self.integrity: Integrity | None = None  # --kv-digest's part, once the KV caches are registered
        self.rank_mismatches: dict[str, str] = {}  # rank 0: request -> a rank > 0's digest mismatch
        self._to_digest: list[tuple[str, list[list[int]]]] = []  # P: this step's prompts, once computed
        self._poll_until = 0.0  # keep progressing NIXL until then (a late read; a notification on its way)

    # --- set-up -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: CanonicalKVCaches) -> None:
        from connectors.nixl.transport import NixlTransport  # imports nixl: only when used
        from connectors.nixl.ucx import configure_ucx
        from connectors.nixl.ucx import describe as describe_ucx
        from connectors.nixl.ucx import path as ucx_path

        configure_ucx(self.config.transfer.host, self.config.transfer.ucx_transports, cuda=torch.cuda.is_available(),
                      kv_on_gpu=kv_caches.tensors[0].device.type == "cuda")
        self.integrity = Integrity(kv_caches, self.digest_book)
        self.stats.path = ucx_path()
        if self.config.rank == 0:
            logger.info("KV transfers on %s: %s", self.config.transfer.host, describe_ucx())
        if self.config.rank > 0:  # its reads only: leases and the side channel are rank 0's
            self.transport = self.peers.transport = NixlTransport(self.agent_name, kv_caches)
            return
        self.leases = LeaseTable(kv_caches.tensors[0].num_blocks)  # a held request holds a block at least
        self.holds.leases = self.leases
        self.transport = self.peers.transport = NixlTransport(self.agent_name, kv_caches,
                                                              lease_words=self.leases.words)
        transfer = self.config.transfer
        self.side_channel = SideChannelServer(transfer.host, transfer.side_channel_port, self._respond,
                                              transfer.peers, transfer.handshake_key)

    def rank_info(self) -> RankAgent:
        return RankAgent(self.transport.agent_metadata(), self.transport.local_layout(self.config.compat_hash))

    def add_ranks(self, infos: list[object]) -> None:
        self.rank_agents = [info for info in infos if isinstance(info, RankAgent)]
        if len(self.rank_agents) != self.config.tp_size - 1:
            raise ValueError(f"{len(self.rank_agents)} ranks reported their NIXL agents, "
                             f"{self.config.tp_size - 1} expected")

    def add_rank_outputs(self, outputs: list[KVConnectorOutput]) -> None:
        for rank, output in enumerate(outputs, start=1):
            for req_id in output.finished_recving:
                self.rank_results.setdefault(req_id, {})[rank] = None
                self.rank_sizes.setdefault(req_id, {})[rank] = output.load_sizes.get(req_id, (0, 0))
            for req_id, why in output.failed_recving.items():
                self.rank_results.setdefault(req_id, {})[rank] = why
            for req_id, why in output.digest_mismatches.items():
                self.rank_mismatches.setdefault(req_id, f"(tensor-parallel rank {rank}) {why}")
            if self.digest_book is not None:
                for req_id, digests in output.digests.items():
                    self.digest_book.put(req_id, rank, digests)

    @property
    def side_channel_port(self) -> int:
        """The port bound (the configured one, or a free one when it was 0)."""
        return self.side_channel.port

    def _respond(self, request: HandshakeRequest) -> HandshakeResponse | HandshakeError:
        if request.compat_hash != self.config.compat_hash:
            return HandshakeError(f"incompatible KV layout: peer {request.engine_id!r} has "
                                  f"{request.compat_hash[:12]}, this engine {self.config.compat_hash[:12]} "
                                  f"({COMPAT_DIFFERS})")
        self.answered.note(request.engine_id)
        return HandshakeResponse(self.transport.agent_metadata(), self.transport.local_layout(self.config.compat_hash),
                                 self.rank_agents)

    # --- every step ---------------------------------------------------------------
    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        self._to_digest = metadata.reqs_to_digest
        for recv in metadata.reqs_to_recv:
            self._start_read(recv)
        if self.config.rank > 0:
            return  # leases, rejects and KeepAlives are rank 0's
        for send in metadata.reqs_to_send:
            self.holds.hold(send.request_id, send.deadline)
        for req_id in metadata.reqs_to_release:
            self.holds.release(req_id)
        for remote, reason in metadata.reqs_to_reject:
            self._reject(remote, reason)
        for remote in metadata.reqs_to_keep_alive:
            self._notify(remote, KeepAlive(remote.remote_request_id))

    def _start_read(self, recv: ReqToRecv) -> None:
        self.peers.when_ready(recv.remote, lambda: self._post_read(recv), lambda why: self._fail_read(recv, why))

    def _post_read(self, recv: ReqToRecv) -> None:
        """The data READs, one per P rank read from; the read-done notification rides on
        the READ only when it is the one READ of the request and there is no lease word
        to check after it. A READ that cannot be posted fails the request, once those
        already posted are final."""
        posting = self.config.clock()
        remote = recv.remote
        agents = self.peers.agents[remote.remote_engine_id]
        if remote.tp_size != self.peers.sizes[remote.remote_engine_id]:
            self._fail_read(recv, f"its parameters name tensor-parallel size {remote.tp_size}, its side channel "
                                  f"{self.peers.sizes[remote.remote_engine_id]} ranks")
            return
        one_read = remote.lease_token is None and len(agents) == 1 and self.config.tp_size == 1
        done = encode_notif(ReadDone(remote.remote_request_id)) if one_read else b""
        taken: list[set] = [set() for _ in recv.local_block_ids]
        handles, error, units_read = [], None, []
        for rank, agent in zip(self.peers.ranks[remote.remote_engine_id], agents):
            before = [set(keys) for keys in taken]
            try:
                handles.append(self.transport.start_read(agent, recv.local_block_ids, recv.remote_block_ids,
                                                         done, taken))
            except Exception as exc:  # any transport failure fails this request only
                error = str(exc)
                break
            units_read.append((rank, [keys - seen if self.transport.pieces else {WHOLE}
                                      for keys, seen in zip(taken, before)]))
        if error is not None and not handles:
            self._fail_read(recv, error)
            return
        self.stats.post_time.observe(self.config.clock() - posting)
        self.loading[recv.request_id] = _Loading(recv, handles, self.config.clock(),
                                                 sum(h.num_bytes for h in handles),
                                                 sum(h.num_descriptors for h in handles), error, one_read,
                                                 units_read=units_read)

    def _post_check(self, loading: _Loading) -> str | None:
        """After the data READ: the READ of P's lease word; why it could not be posted, or None."""
        remote = loading.request.remote
        try:
            landing = self.leases.take_landing()
        except RuntimeError as exc:
            return str(exc)
        try:
            loading.handles = [self.transport.start_word_read(remote.remote_engine_id, remote.lease_slot, landing)]
        except Exception as exc:
            self.leases.landed(landing)
            return f"its lease word could not be read: {exc}"
        loading.landing = landing
        return None

    def _fail_read(self, recv: ReqToRecv, why: str) -> None:
        """The request's READs could not start on this rank. Rank 0 of several waits for the
        other ranks' READs to be final before it reports the request (and tells P)."""
        logger.warning("KV read for %s from %s failed to start: %s", recv.request_id, recv.remote.remote_engine_id, why)
        where = f"{recv.remote.remote_host}:{recv.remote.remote_port}"
        if self.config.rank == 0 and self.config.tp_size > 1:
            self.loading[recv.request_id] = _Loading(recv, [], self.config.clock(), 0, 0,
                                                     error=f"could not start: {why}")
            return
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

        self.peers.when_ready(remote, send, unreachable)

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        self.peers.finish()
        output = KVConnectorOutput(failed_recving=self.failed)
        self.failed = {}
        self.integrity.digest_held(self._to_digest, output)
        self._to_digest = []
        self._poll_reads(output)
        notifs = self.transport.get_notifs()  # progresses this agent: P's ranks are read, D's ranks read
        if self.config.rank == 0:
            self.holds.update(notifs, output)
            self.stats.handshakes_refused = self.side_channel.refused
        return output

    def _digest_mismatch(self, loading: _Loading) -> str | None:
        engine_id = loading.request.remote.remote_engine_id
        return self.integrity.mismatch(loading.request, loading.units_read,
                                       lambda rank: self.transport.peer_units(rank_agent_name(engine_id, rank)))

    def _poll_reads(self, output: KVConnectorOutput) -> None:
        for req_id, loading in list(self.loading.items()):
            if loading.outcome is None:
                loading.outcome = self._poll_handles(loading)
                if loading.outcome is None:
                    continue
                if self.config.rank > 0:  # this rank's share, for rank 0
                    del self.loading[req_id]
                    self._report_share(loading, output)
                    continue
            state = self._poll_handles(loading) if loading.landing is not None else self._with_ranks(req_id, loading)
            if state == "DONE" and loading.landing is None and loading.request.remote.lease_token is not None:
                why = self._post_check(loading)  # every rank's data moved: now the lease word
                if why is None:
                    continue
                state = f"ERR: {why}"
            if state is not None:
                del self.loading[req_id]
                self._read_ended(loading, state, output)

    def _poll_handles(self, loading: _Loading) -> str | None:
        """None while a READ of the request's on this rank is under way (one past the
        read timeout is cancelled); else DONE, ERR, TIMEOUT or "ERR: why"."""
        states = [self.transport.poll(handle) for handle in loading.handles]
        if "PROC" in states:
            if self.config.clock() - loading.started < self.config.transfer.read_timeout_s:
                return None
            if not all([self.transport.cancel(handle) for handle in loading.handles]):
                return None  # NIXL cannot stop one yet: the blocks stay its until it can
            return "TIMEOUT"
        if loading.error is not None:
            return f"ERR: {loading.error}"
        return "ERR" if "ERR" in states else "DONE"

    def _with_ranks(self, req_id: str, loading: _Loading) -> str | None:
        """Rank 0: the request's data state once every rank's READs are final (None until
        then): this rank's, else the first failed rank's."""
        if self.config.tp_size == 1:
            return loading.outcome
        results = self.rank_results.get(req_id, {})
        if len(results) < self.config.tp_size - 1:
            return None
        del self.rank_results[req_id]
        failed = [(rank, why) for rank, why in sorted(results.items()) if why is not None]
        if loading.outcome != "DONE" or not failed:
            return loading.outcome
        rank, why = failed[0]
        return f"ERR: (tensor-parallel rank {rank}) {why}"

    def _report_share(self, loading: _Loading, output: KVConnectorOutput) -> None:
        """A rank > 0: its READs of the request are final."""
        req_id = loading.request.request_id
        if loading.outcome == "DONE":
            output.finished_recving.add(req_id)
            output.load_sizes[req_id] = (loading.num_bytes, loading.num_descriptors)
            if (why := self._digest_mismatch(loading)) is not None:
                output.digest_mismatches[req_id] = why
            return
        output.failed_recving[req_id] = _failure(loading.outcome, self.config.transfer.read_timeout_s)
        self.stats.failures += 1

    def _read_ended(self, loading: _Loading, state: str, output: KVConnectorOutput) -> None:
        """Report a read whose READs are final: received (verified or not) or failed."""
        req_id, remote = loading.request.request_id, loading.request.remote
        word = self.leases.landed(loading.landing) if loading.landing is not None else None
        shares = {0: (loading.num_bytes, loading.num_descriptors), **self.rank_sizes.pop(req_id, {})}
        lease = remote.lease_expires_at
        ranks_mismatch = self.rank_mismatches.pop(req_id, None)
        if state == "DONE" and word is not None and word != remote.lease_token:
            why = "found its blocks freed by the prefill server before the read ended (released, or its lease ended)"
        elif state == "DONE" and lease is not None and self.config.wall_clock() >= lease:
            why = "ended after the prefill server's lease"
        elif state == "DONE" and (mismatched := self._digest_mismatch(loading) or ranks_mismatch) is not None:
            why = f"{DIGEST_MISMATCH}: {mismatched}"
            self.stats.digest_mismatches += 1
            self._reject(remote, f"the read {why}")  # nothing retries it: P frees its blocks
        elif state == "DONE":
            if remote.kv_digests is not None:
                self.stats.digests_checked += 1
            self.integrity.garble(loading.request)
            output.finished_recving.add(req_id)
            output.load_sizes[req_id] = (sum(b for b, _ in shares.values()), sum(d for _, d in shares.values()))
            if not loading.notified:  # checked (or no word to check): P may free the blocks now
                self._notify(remote, ReadDone(remote.remote_request_id))
            if word is None or not loading.request.trusted:
                output.unverified.add(req_id)
            self.stats.read_done(self.config.clock() - loading.started, shares)
            return
        else:
            why = _failure(state, self.config.transfer.read_timeout_s)
            self._reject(remote, f"the read {why}")  # nothing retries it: P frees its blocks
        logger.warning("KV read for %s from %s %s", req_id, remote.remote_engine_id, why)
        output.failed_recving[req_id] = f"the read from {remote.remote_engine_id} {why}"
        self.stats.failures += 1

    def _poll_for(self, seconds: float) -> None:
        self._poll_until = max(self._poll_until, self.config.clock() + seconds)

    @property
    def wants_polling(self) -> bool:
        """Reads, handshakes and leases in progress, and for a while after a lease expired:
        a decode server may still be reading, and without a progress thread its read
        moves only while both sides poll (it then ends, as a failure, on D); and for a
        while after a notification was sent, which moves only while the sender polls."""
        busy = self.holds or self.loading or self.peers.busy
        return bool(busy) or self.config.clock() < self._poll_until

    def malformed_messages(self) -> dict[str, int]:
        return {"nixl_notification": self.stats.malformed_notifications,
                "side_channel": self.side_channel.malformed if self.side_channel is not None else 0}

    @property
    def num_requests_held(self) -> int:
        return len(self.holds)

    def shutdown(self) -> None:
        self.peers.close()
        if self.side_channel is not None:
            self.side_channel.close()
        if self.transport is not None:
            self.transport.close()


def _failure(state: str, read_timeout_s: float) -> str:
    """What a failed READ state says, after "the read ..."."""
    return {"ERR": "failed in transfer",
            "TIMEOUT": f"was still under way after {read_timeout_s:g} s"}.get(state, state.removeprefix("ERR: "))
