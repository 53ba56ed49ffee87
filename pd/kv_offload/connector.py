"""The offload tiers as both halves of a KV connector wrapped around the engine's own (null
or NIXL), so that a tier load is parked, landed, failed and aborted exactly like a load
from a prefill server (pd/scheduling/remote_kv.py), and PD goes on unchanged. The worker
half is worker.py; this is the scheduler half and the engine's doors to both.

- **Stores**: every block the prefix cache takes (`BlockPool.cache_log`) gets a slot in
  every tier (each tier's LRU evicts), and is pinned (one reference per tier,
  `KVCacheManager.pin`) until that write ends: a block is never evicted from the device
  while a copy of it is under way.
- **Loads**: a request that loads nothing from elsewhere and whose prompt goes on in the
  tiers past its device hit (`lookup.tier_hit`, a block counting when any tier holds it)
  gets blocks for that part and waits (WAITING_FOR_REMOTE_KVS) while each block is read
  from the fastest tier holding it; the slots read are kept from eviction until the read
  ends. A load that fails (a checksum, a tier off) makes the request compute those
  tokens, whatever the load failure policy.
- The worker's reports (`KVConnectorOutput.offload`, per tier) end stores, drop corrupt
  blocks, and turn a tier off for good when the worker did.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from kv_events.messages import BlockRemoved, BlockStored, KVEvent
from pd.config import TierSettings
from pd.contracts.connector_api import KVConnectorOutput, KVConnectorScheduler, KVConnectorWorker, OffloadReport
from pd.contracts.request import Request
from pd.histogram import Histogram
from pd.kv_cache.block_pool import KVCacheBlock
from pd.kv_cache.kv_cache_manager import KVCacheBlocks, KVCacheManager
from pd.kv_offload.index import Key, TierIndex
from pd.kv_offload.lookup import tier_hit
from pd.kv_offload.tier import TierBlock
from pd.kv_offload.worker import TieredMetadata, TieredWorker
from pd.kv_transfer.params import RemotePrefillParams

logger = logging.getLogger(__name__)


class TieredScheduler(KVConnectorScheduler):
    def __init__(self, inner: KVConnectorScheduler, kv: KVCacheManager, worker: TieredWorker) -> None:
        self.inner, self.kv = inner, kv
        self.indexes: dict[str, TierIndex] = {  # fastest first; a tier that failed at start has none
            name: TierIndex(name, tier.num_slots, tier.restored, record=kv.pool.record_events)
            for name, tier in worker.tiers.items() if tier.off_reason is None}
        kv.pool.cache_log = [] if self.indexes else None
        self.storing: dict[tuple[str, Key], KVCacheBlock] = {}  # (tier, key): pinned until that write ends
        self.to_store: dict[str, list[TierBlock]] = {}
        self.to_load: dict[str, dict[str, list[TierBlock]]] = {}
        self.loading: dict[str, dict[str, list[int]]] = {}  # request -> tier -> the slots it reads
        self.planned: dict[str, int] = {}  # request -> its device hit, between lookup and allocation
        self.refused: dict[str, str] = {}  # requests whose load cannot start, to report failed
        self.events: list[KVEvent] = []  # of tiers that turned off

    def _holds(self, key: Key) -> bool:
        return any(key in index for index in self.indexes.values())

    # --- loads ---
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        self.planned.pop(request.request_id, None)  # an earlier try whose allocation failed
        num, load_async = self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
        if num or load_async or request.kv_source is not None or not self.indexes \
                or not (self.kv.enable_caching and request.reads_prefix_cache):
            return num, load_async
        length = tier_hit(self.kv.coordinator.managers, self._holds, request.block_hashes, num_computed_tokens,
                          request.num_tokens - 1)
        if length <= num_computed_tokens:
            return 0, False
        self.planned[request.request_id] = num_computed_tokens
        return length - num_computed_tokens, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self.planned.pop(request.request_id, None) is None:
            self.inner.update_state_after_alloc(request, blocks, num_external_tokens)
            return
        parts = self._parts(request, blocks)
        # its tokens count as from the slowest tier it reads (a tier name in any case: a failed load is recomputed)
        request.kv_loaded_from = list(parts or self.indexes or ["disk"])[-1]
        if parts is None:
            self.refused[request.request_id] = "its blocks left the KV offload tiers before the load"
            return
        self.loading[request.request_id] = {}
        for name, loads in parts.items():
            slots = [b.slot for b in loads]
            self.indexes[name].begin_read(slots)
            self.indexes[name].touch([(b.block_hash, b.group) for b in loads])
            self.loading[request.request_id][name] = slots
        self.to_load[request.request_id] = parts

    def _parts(self, request: Request, blocks: KVCacheBlocks) -> dict[str, list[TierBlock]] | None:
        """Per tier (fastest first), the blocks the allocation left unfilled that it gives;
        None if one is in no tier."""
        parts: dict[str, list[TierBlock]] = {}
        for group, ids in enumerate(blocks.get_unfilled_block_ids()):
            hashes = request.block_hashes(self.kv.coordinator.managers[group].block_size)
            for position, block_id in enumerate(ids):
                if not block_id:
                    continue
                key = (hashes[position], group)
                name = next((n for n, index in self.indexes.items() if key in index), None)
                if name is None:
                    return None
                parts.setdefault(name, []).append(TierBlock(self.indexes[name].slot(key), group, block_id, key[0]))
        return {name: parts[name] for name in self.indexes if name in parts}

    # --- each step ---
    def build_connector_meta(self) -> TieredMetadata:
        meta = TieredMetadata(self.inner.build_connector_meta(), self.to_store, self.to_load)
        self.to_store, self.to_load = {}, {}
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        output.failed_recving.update(self.refused)
        self.refused = {}
        for request_id in [*output.finished_recving, *output.failed_recving]:
            for name, slots in self.loading.pop(request_id, {}).items():
                if name in self.indexes:
                    self.indexes[name].end_read(slots)
        for name, report in (output.offload or {}).items():
            self._end_stores(name, report)
        self.inner.update_connector_output(output)
        self._take_cached()

    def _end_stores(self, name: str, report: OffloadReport) -> None:
        index = self.indexes.get(name)
        for key, ok in [*((k, True) for k in report.stored), *((k, False) for k in report.store_failed)]:
            if index is not None:
                index.stored(key, ok)
            block = self.storing.pop((name, key), None)
            if block is not None:
                self.kv.unpin(block)
        if index is not None:
            for key in report.corrupt:
                index.drop(key)
            if report.off is not None:
                self._turn_off(name)

    def _turn_off(self, name: str) -> None:
        """The worker turned a tier off: forget it, and let the blocks pinned for it go."""
        index = self.indexes.pop(name)
        index.clear()
        self.events += self._events(name, index)
        for tier, key in [k for k in self.storing if k[0] == name]:
            self.kv.unpin(self.storing.pop((tier, key)))
        self.to_store.pop(name, None)
        if not self.indexes:
            self.kv.pool.cache_log = None

    def _take_cached(self) -> None:
        """Give each block the prefix cache took since the last step a slot in every tier, and pin it."""
        if not self.indexes:
            return
        cached, self.kv.pool.cache_log = self.kv.pool.cache_log, []
        for block, key in cached:
            if block.block_hash is not key:
                continue  # evicted (and maybe reused) since
            for name, index in self.indexes.items():
                slot = index.reserve((key.block_hash, key.group_id))
                if slot is None:
                    continue
                self.kv.pin(block)
                self.storing[(name, (key.block_hash, key.group_id))] = block
                self.to_store.setdefault(name, []).append(TierBlock(slot, key.group_id, block.block_id,
                                                                    key.block_hash))

    # --- events ---
    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events + self.inner.take_events(), []
        for name, index in self.indexes.items():
            events += self._events(name, index)
        return events

    def _events(self, name: str, index: TierIndex) -> list[KVEvent]:
        return self._stored(name, index.take_added()) + [
            BlockRemoved(hashes, group, medium=name) for group, hashes in _by_group(index.take_removed()).items()]

    def held_events(self) -> list[KVEvent]:
        return self.inner.held_events() + [e for name, index in self.indexes.items()
                                           for e in self._stored(name, list(index.held))]

    def _stored(self, name: str, keys: list[Key]) -> list[KVEvent]:
        sizes = self.kv.config.block_sizes
        return [BlockStored(hashes, None, len(hashes) * sizes[group], group, medium=name)
                for group, hashes in _by_group(keys).items()]

    @property
    def has_work(self) -> bool:
        return bool(self.storing or self.to_store or self.loading or self.refused) or self.inner.has_work

    # --- the rest is the inner connector's ---
    def request_finished(self, request: Request,
                         block_ids: list[list[int]]) -> tuple[bool, RemotePrefillParams | None]:
        self.planned.pop(request.request_id, None)
        return self.inner.request_finished(request, block_ids)

    def requests_waiting(self, requests: Iterable[Request]) -> None:
        self.inner.requests_waiting(requests)

    def prompt_computed(self, request: Request, block_ids: list[list[int]]) -> None:
        self.inner.prompt_computed(request, block_ids)

    @property
    def hands_on_after_a_step(self) -> bool:
        return self.inner.hands_on_after_a_step

    def handing_on(self, request: Request, block_ids: list[list[int]], num_tokens: int) -> None:
        self.inner.handing_on(request, block_ids, num_tokens)

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)

    def figures(self, name: str) -> dict[str, float]:
        """A tier's scheduler-side figures (for metrics)."""
        index = self.indexes.get(name)
        return {"usage": index.usage if index else 0.0, "blocks": float(len(index.held)) if index else 0.0,
                "on": float(index is not None)}


def _by_group(keys: list[Key]) -> dict[int, list[bytes]]:
    by_group: dict[int, list[bytes]] = {}
    for block_hash, group in keys:
        by_group.setdefault(group, []).append(block_hash)
    return by_group


def with_tiers(worker: KVConnectorWorker, settings: TierSettings) -> KVConnectorWorker:
    """The engine's worker half, wrapped with the tiers when any is configured."""
    return TieredWorker(worker, settings) if settings.offload.any else worker


def inner_worker(worker: KVConnectorWorker) -> KVConnectorWorker:
    """The connector's own worker half (what its scheduler half is built with)."""
    return worker.inner if isinstance(worker, TieredWorker) else worker


def tiered_scheduler(scheduler: KVConnectorScheduler, kv: KVCacheManager,
                     worker: KVConnectorWorker) -> KVConnectorScheduler:
    """The connector's scheduler half, wrapped when its worker half has tiers."""
    return TieredScheduler(scheduler, kv, worker) if isinstance(worker, TieredWorker) else scheduler


def offload_figures(scheduler: KVConnectorScheduler, worker: KVConnectorWorker) -> dict[str, dict[str, float]]:
    """Per tier, its counters (the worker's) and gauges (the scheduler's); empty without tiers."""
    if not isinstance(scheduler, TieredScheduler):
        return {}
    return {name: {k: float(v) for k, v in tier.counters.items()} | scheduler.figures(name)
            | {"capacity_bytes": float(tier.num_slots * tier.slot_bytes)} for name, tier in worker.tiers.items()}


def offload_load_seconds(worker: KVConnectorWorker) -> dict[str, Histogram]:
    """Per tier, how long its loads took."""
    return worker.load_seconds if isinstance(worker, TieredWorker) else {}


def offload_description(worker: KVConnectorWorker) -> list[str]:
    """A line per tier for the server's start-up output."""
    return [tier.description() for tier in worker.tiers.values()] if isinstance(worker, TieredWorker) else []
