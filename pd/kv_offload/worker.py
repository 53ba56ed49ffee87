"""The worker half of the offload tiers: the engine connector's own worker half, plus the
tiers (host, then disk), built once the KV cache is allocated.

A load may take its blocks from several tiers; the request is reported loaded once every
tier has read its part, or failed once every part has ended and one failed (never
before: another tier may still be writing the request's blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pd.config import TierSettings
from pd.contracts.connector_api import KVConnectorMetadata, KVConnectorOutput, KVConnectorWorker, OffloadReport
from pd.histogram import SECONDS_BUCKETS, Histogram
from pd.kv_cache.canonical import CanonicalKVCaches
from pd.kv_offload.disk import DiskTier
from pd.kv_offload.host import HostTier
from pd.kv_offload.tier import Tier, TierBlock


def build_tiers(settings: TierSettings, caches: CanonicalKVCaches) -> list[Tier]:
    """The tiers, fastest first."""
    tiers: list[Tier] = []
    offload = settings.offload
    if offload.host_bytes is not None:
        tiers.append(HostTier(offload.host_bytes, caches))
    if offload.disk_path is not None:
        tiers.append(DiskTier(offload.disk_path, offload.disk_bytes, caches, settings.compat_hash,
                              f"{settings.engine_id}-disk"))
    return tiers


@dataclass
class TieredMetadata(KVConnectorMetadata):
    inner: KVConnectorMetadata
    stores: dict[str, list[TierBlock]] = field(default_factory=dict)  # tier -> blocks to write
    loads: dict[str, dict[str, list[TierBlock]]] = field(default_factory=dict)  # request -> tier -> blocks


@dataclass
class _Load:
    parts: set[str]  # tiers still reading
    error: str | None = None


class TieredWorker(KVConnectorWorker):
    def __init__(self, inner: KVConnectorWorker, settings: TierSettings) -> None:
        self.inner, self.settings = inner, settings
        self.tiers: dict[str, Tier] = {}
        self.load_seconds: dict[str, Histogram] = {}
        self.loads: dict[str, _Load] = {}

    def register_kv_caches(self, kv_caches: CanonicalKVCaches) -> None:
        self.inner.register_kv_caches(kv_caches)
        self.tiers = {tier.name: tier for tier in build_tiers(self.settings, kv_caches)}
        self.load_seconds = {name: Histogram(SECONDS_BUCKETS) for name in self.tiers}

    def start_load_kv(self, metadata: TieredMetadata) -> None:
        self.inner.start_load_kv(metadata.inner)
        for name, blocks in metadata.stores.items():
            self.tiers[name].store(blocks)
        for request_id, parts in metadata.loads.items():
            self.loads[request_id] = _Load(set(parts))
            for name, blocks in parts.items():
                self.tiers[name].load(request_id, blocks)

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        output = self.inner.get_finished(finished_req_ids)
        output.offload = {}
        for name, tier in self.tiers.items():
            ended = tier.poll()
            for request_id in ended.loaded:
                self._part_ended(output, request_id, name, None)
            for request_id, why in ended.load_failed.items():
                self._part_ended(output, request_id, name, why)
            for seconds in ended.load_seconds:
                self.load_seconds[name].observe(seconds)
            output.offload[name] = OffloadReport(ended.stored, ended.store_failed, ended.corrupt, tier.off_reason)
        return output

    def _part_ended(self, output: KVConnectorOutput, request_id: str, tier: str, error: str | None) -> None:
        load = self.loads.get(request_id)
        if load is None:
            return
        load.parts.discard(tier)
        load.error = load.error or error
        if load.parts:
            return
        del self.loads[request_id]
        if load.error is None:
            output.finished_recving.add(request_id)
        else:
            output.failed_recving[request_id] = load.error

    @property
    def wants_polling(self) -> bool:
        return self.inner.wants_polling or any(tier.busy for tier in self.tiers.values())

    @property
    def stats(self) -> object | None:
        return getattr(self.inner, "stats", None)

    @property
    def num_requests_held(self) -> int:
        return getattr(self.inner, "num_requests_held", 0)

    def malformed_messages(self) -> dict[str, int]:
        return self.inner.malformed_messages()

    def shutdown(self) -> None:
        self.inner.shutdown()
        for tier in self.tiers.values():
            tier.shutdown()
