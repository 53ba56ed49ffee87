"""What every offload tier is: slots of one block each, written and read in jobs that
`poll` reports ended. `DiskTier` (disk.py) and `HostTier` (host.py) are the two."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pd.kv_cache.canonical import CanonicalKVCaches
from pd.kv_offload.index import Key


@dataclass(frozen=True)
class TierBlock:
    """One block to move: device block `block_id` of `group` <-> tier slot `slot`."""

    slot: int
    group: int
    block_id: int
    block_hash: bytes


@dataclass
class Finished:
    """What `DiskTier.poll` found ended since the last call."""

    stored: list[Key] = field(default_factory=list)
    store_failed: list[Key] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)
    load_failed: dict[str, str] = field(default_factory=dict)
    corrupt: list[Key] = field(default_factory=list)  # held blocks whose bytes failed their checksum
    load_seconds: list[float] = field(default_factory=list)


def slot_bytes(caches: CanonicalKVCaches) -> int:
    """Bytes of the largest group's block: the size of every slot."""
    return max(sum(ref.page_size_bytes for ref in refs) for refs in caches.group_data_refs)


class Tier(Protocol):
    """An offload tier's worker side. `store` and `load` post jobs (a store's blocks must
    not change, a load's blocks not be used, until `poll` reports them ended); every job
    ends, stored or failed, loaded or failed. A tier that cannot go on sets `off_reason`
    and from then on fails what it is given."""

    name: str
    num_slots: int
    slot_bytes: int
    off_reason: str | None
    counters: dict[str, int]

    @property
    def busy(self) -> bool: ...  # jobs under way: the engine polls it
    @property
    def restored(self) -> list[tuple[Key, int]]: ...  # (key, slot) held at start, oldest first
    def store(self, blocks: list[TierBlock]) -> None: ...
    def load(self, request_id: str, blocks: list[TierBlock]) -> None: ...
    def poll(self) -> Finished: ...
    def description(self) -> str: ...
    def shutdown(self) -> None: ...


COUNTERS = ("stored_blocks", "stored_bytes", "loaded_blocks", "loaded_bytes", "store_failures", "load_failures",
            "corrupt_blocks")
