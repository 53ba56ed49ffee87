"""The disk tier as both halves of a KV connector wrapped around the engine's own (null
or NIXL), so that a tier load is parked, landed, failed and aborted exactly like a load
from a prefill server (pd/scheduling/remote_kv.py), and PD goes on unchanged.

Scheduler half (`TieredScheduler`):
- **Stores**: every block the prefix cache takes (`BlockPool.cache_log`) gets a tier slot
  (the tier's LRU evicts), and is pinned (one reference, `KVCacheManager.pin`) until
  its write ends: a block is never evicted from the device while its copy is under way.
- **Loads**: a request that loads nothing from elsewhere and whose prompt goes on in the
  tier past its device hit (`lookup.tier_hit`) gets blocks for that part and waits
  (WAITING_FOR_REMOTE_KVS) while the worker reads them; the slots read are kept from
  eviction until the read ends. A load that fails (a checksum, the tier off) makes the
  request compute those tokens, whatever the load failure policy.
- The worker's report (`KVConnectorOutput.offload`) ends stores, drops corrupt blocks,
  and turns the tier off for good when the worker did.

Worker half (`TieredWorker`): the inner connector's half plus a `DiskTier`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from kv_events.messages import BlockRemoved, BlockStored, KVEvent
from pd.histogram import SECONDS_BUCKETS, Histogram
from pd.kv_cache.block_pool import KVCacheBlock
from pd.kv_cache.kv_cache_manager import KVCacheBlocks, KVCacheManager
from pd.kv_offload.disk import DiskTier, TierBlock, default_disk_bytes
from pd.kv_offload.index import Key, TierIndex
from pd.kv_offload.lookup import tier_hit
from pd.scheduling.connector_api import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    OffloadReport,
)
from pd.scheduling.request import Request

logger = logging.getLogger(__name__)

TIER = "disk"


@dataclass
class TieredMetadata(KVConnectorMetadata):
    inner: KVConnectorMetadata
    stores: list[TierBlock] = field(default_factory=list)
    loads: dict[str, list[TierBlock]] = field(default_factory=dict)


class TieredWorker(KVConnectorWorker):
    def __init__(self, inner: KVConnectorWorker, directory: Path, nbytes: int, compat_hash: str,
                 agent_name: str) -> None:
        self.inner = inner
        self.directory, self.nbytes, self.compat_hash, self.agent_name = directory, nbytes, compat_hash, agent_name
        self.tier: DiskTier | None = None
        self.load_seconds = Histogram(SECONDS_BUCKETS)

    def register_kv_caches(self, kv_caches) -> None:
        self.inner.register_kv_caches(kv_caches)
        self.tier = DiskTier(self.directory, self.nbytes, kv_caches, self.compat_hash, self.agent_name)

    def start_load_kv(self, metadata: TieredMetadata) -> None:
        self.inner.start_load_kv(metadata.inner)
        self.tier.store(metadata.stores)
        for request_id, blocks in metadata.loads.items():
            self.tier.load(request_id, blocks)

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        output = self.inner.get_finished(finished_req_ids)
        ended = self.tier.poll()
        output.finished_recving.update(ended.loaded)
        output.failed_recving.update(ended.load_failed)
        output.offload = OffloadReport(ended.stored, ended.store_failed, ended.corrupt, self.tier.off_reason)
        for seconds in ended.load_seconds:
            self.load_seconds.observe(seconds)
        return output

    @property
    def wants_polling(self) -> bool:
        return self.inner.wants_polling or bool(self.tier and self.tier.transfers)

    @property
    def stats(self):
        return getattr(self.inner, "stats", None)

    @property
    def num_requests_held(self) -> int:
        return getattr(self.inner, "num_requests_held", 0)

    def malformed_messages(self) -> dict[str, int]:
        return self.inner.malformed_messages()

    def shutdown(self) -> None:
        self.inner.shutdown()
        if self.tier is not None:
            self.tier.shutdown()


class TieredScheduler(KVConnectorScheduler):
    def __init__(self, inner: KVConnectorScheduler, kv: KVCacheManager, worker: TieredWorker) -> None:
        self.inner, self.kv = inner, kv
        tier = worker.tier
        self.index: TierIndex | None = None
        if tier.off_reason is None:
            self.index = TierIndex(TIER, tier.num_slots, tier.restored)
            kv.pool.cache_log = []
        self.storing: dict[Key, KVCacheBlock] = {}  # pinned until their write ends
        self.to_store: list[TierBlock] = []
        self.to_load: dict[str, list[TierBlock]] = {}
        self.loading: dict[str, list[int]] = {}  # request -> the slots it reads
        self.planned: dict[str, int] = {}  # request -> its device hit, between lookup and allocation
        self.refused: dict[str, str] = {}  # requests whose load cannot start, to report failed
        self.events: list[KVEvent] = []  # of an index dropped when the tier turned off

    # --- loads ---
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        self.planned.pop(request.request_id, None)  # an earlier try whose allocation failed
        num, load_async = self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
        if num or load_async or request.kv_source is not None or self.index is None \
                or not (self.kv.enable_caching and request.reads_prefix_cache):
            return num, load_async
        length = tier_hit(self.kv.coordinator.managers, self.index.__contains__, request.block_hashes,
                          num_computed_tokens, request.num_tokens - 1)
        if length <= num_computed_tokens:
            return 0, False
        self.planned[request.request_id] = num_computed_tokens
        return length - num_computed_tokens, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self.planned.pop(request.request_id, None) is None:
            self.inner.update_state_after_alloc(request, blocks, num_external_tokens)
            return
        loads = self._loads(request, blocks)
        request.kv_loaded_from = TIER
        if loads is None or self.index is None:
            self.refused[request.request_id] = "its blocks left the KV disk tier before the load"
            return
        slots = [b.slot for b in loads]
        self.index.begin_read(slots)
        self.index.touch([(b.block_hash, b.group) for b in loads])
        self.loading[request.request_id] = slots
        self.to_load[request.request_id] = loads

    def _loads(self, request: Request, blocks: KVCacheBlocks) -> list[TierBlock] | None:
        """The tier's slot for each block the allocation left unfilled; None if one is missing."""
        loads = []
        for group, ids in enumerate(blocks.get_unfilled_block_ids()):
            hashes = request.block_hashes(self.kv.coordinator.managers[group].block_size)
            for position, block_id in enumerate(ids):
                if not block_id:
                    continue
                slot = self.index.slot((hashes[position], group)) if self.index is not None else None
                if slot is None:
                    return None
                loads.append(TierBlock(slot, group, block_id, hashes[position]))
        return loads

    # --- each step ---
    def build_connector_meta(self) -> TieredMetadata:
        meta = TieredMetadata(self.inner.build_connector_meta(), self.to_store, self.to_load)
        self.to_store, self.to_load = [], {}
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        output.failed_recving.update(self.refused)
        self.refused = {}
        for request_id in [*output.finished_recving, *output.failed_recving]:
            slots = self.loading.pop(request_id, None)
            if slots is not None and self.index is not None:
                self.index.end_read(slots)
        if output.offload is not None:
            self._end_stores(output.offload)
        self.inner.update_connector_output(output)
        self._take_cached()

    def _end_stores(self, report: OffloadReport) -> None:
        for key, ok in [*((k, True) for k in report.stored), *((k, False) for k in report.store_failed)]:
            if self.index is not None:
                self.index.stored(key, ok)
            block = self.storing.pop(key, None)
            if block is not None:
                self.kv.unpin(block)
        if self.index is not None:
            for key in report.corrupt:
                self.index.drop(key)
        if report.off is not None and self.index is not None:
            self._turn_off()

    def _turn_off(self) -> None:
        """The worker turned the tier off: forget it, and let every pinned block go."""
        self.index.clear()
        self.events = self.take_events()
        self.index = None
        self.kv.pool.cache_log = None
        for block in self.storing.values():
            self.kv.unpin(block)
        self.storing.clear()
        self.to_store = []

    def _take_cached(self) -> None:
        """Give each block the prefix cache took since the last step a tier slot, and pin it."""
        if self.index is None:
            return
        cached, self.kv.pool.cache_log = self.kv.pool.cache_log, []
        for block, key in cached:
            if block.block_hash is not key:
                continue  # evicted (and maybe reused) since
            slot = self.index.reserve((key.block_hash, key.group_id))
            if slot is None:
                continue
            self.kv.pin(block)
            self.storing[(key.block_hash, key.group_id)] = block
            self.to_store.append(TierBlock(slot, key.group_id, block.block_id, key.block_hash))

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events + self.inner.take_events(), []
        if self.index is not None:
            events += self._stored(self.index.take_added()) + self._removed(self.index.take_removed())
        return events if self.kv.pool.record_events else []

    def held_events(self) -> list[KVEvent]:
        return self.inner.held_events() + (self._stored(list(self.index.held)) if self.index is not None else [])

    def _stored(self, keys: list[Key]) -> list[KVEvent]:
        sizes = self.kv.config.block_sizes
        return [BlockStored(hashes, None, len(hashes) * sizes[group], group, medium=TIER)
                for group, hashes in _by_group(keys).items()]

    @staticmethod
    def _removed(keys: list[Key]) -> list[KVEvent]:
        return [BlockRemoved(hashes, group, medium=TIER) for group, hashes in _by_group(keys).items()]

    @property
    def has_work(self) -> bool:
        return bool(self.storing or self.to_store or self.loading or self.refused) or self.inner.has_work

    # --- the rest is the inner connector's ---
    def request_finished(self, request: Request, block_ids: list[list[int]]):
        self.planned.pop(request.request_id, None)
        return self.inner.request_finished(request, block_ids)

    def requests_waiting(self, requests) -> None:
        self.inner.requests_waiting(requests)

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)

    def figures(self) -> dict[str, float]:
        """The tier's scheduler-side figures (for metrics)."""
        index = self.index
        return {"usage": index.usage if index else 0.0,
                "blocks": float(len(index.held)) if index else 0.0, "on": float(index is not None)}


def _by_group(keys: list[Key]) -> dict[int, list[bytes]]:
    by_group: dict[int, list[bytes]] = {}
    for block_hash, group in keys:
        by_group.setdefault(group, []).append(block_hash)
    return by_group


def with_tier(worker: KVConnectorWorker, directory: Path | None, nbytes: int | None, compat_hash: str,
              engine_id: str) -> KVConnectorWorker:
    """The engine's worker half, wrapped with a disk tier when a directory is given."""
    if directory is None:
        return worker
    nbytes = nbytes if nbytes is not None else default_disk_bytes(directory)
    return TieredWorker(worker, directory, nbytes, compat_hash, f"{engine_id}-disk")


def inner_worker(worker: KVConnectorWorker) -> KVConnectorWorker:
    """The connector's own worker half (what its scheduler half is built with)."""
    return worker.inner if isinstance(worker, TieredWorker) else worker


def tiered_scheduler(scheduler: KVConnectorScheduler, kv: KVCacheManager,
                     worker: KVConnectorWorker) -> KVConnectorScheduler:
    """The connector's scheduler half, wrapped when its worker half has a tier."""
    return TieredScheduler(scheduler, kv, worker) if isinstance(worker, TieredWorker) else scheduler


def offload_figures(scheduler: KVConnectorScheduler, worker: KVConnectorWorker) -> dict[str, float]:
    """The disk tier's counters (the worker's) and gauges (the scheduler's); empty without a tier."""
    if not isinstance(scheduler, TieredScheduler) or worker.tier is None:
        return {}
    return {name: float(value) for name, value in worker.tier.counters.items()} | scheduler.figures() | {
        "capacity_bytes": float(worker.tier.num_slots * worker.tier.slot_bytes)}


def offload_load_seconds(worker: KVConnectorWorker) -> Histogram | None:
    """How long the disk tier's loads took; None without a tier."""
    return worker.load_seconds if isinstance(worker, TieredWorker) else None


def offload_description(worker: KVConnectorWorker) -> str | None:
    """One line on the disk tier for the server's start-up output; None without one."""
    if not isinstance(worker, TieredWorker):
        return None
    return worker.tier.description()
