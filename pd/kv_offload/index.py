"""What one lower tier holds, as the scheduler sees it: slots by (block hash, group).

A slot is free, being written (`storing`: not readable yet), or holding a block
(`held`, in LRU order, oldest first). A new store takes a free slot, else the oldest held
one that no load is reading; a held block that is hit or stored again moves to the back.
With `record`, blocks evicted from the tier are collected in `removed` until
`take_removed` (for KV events), blocks whose store finished in `added`; without, nothing
is collected.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

Key = tuple[bytes, int]  # (block hash, KV cache group)


class TierIndex:
    def __init__(self, name: str, num_slots: int, entries: Iterable[tuple[Key, int]] = (),
                 record: bool = True) -> None:
        """`entries`: (key, slot) the tier already holds (a warm restart), oldest first."""
        if num_slots < 1:
            raise ValueError(f"a {name} tier needs at least one slot, got {num_slots}")
        self.name = name
        self.num_slots = num_slots
        self.held: OrderedDict[Key, int] = OrderedDict(entries)
        self.storing: dict[Key, int] = {}
        self.readers: Counter[int] = Counter()  # slot -> loads reading it
        self.dropped: set[int] = set()  # slots of dropped blocks, free once no load reads them
        used = set(self.held.values())
        if len(used) != len(self.held) or any(not 0 <= s < num_slots for s in used):
            raise ValueError(f"{name} tier entries name slots twice or outside [0, {num_slots})")
        self.free = [s for s in range(num_slots - 1, -1, -1) if s not in used]  # popped from the end: low first
        self.record = record
        self.removed: list[Key] = []
        self.added: list[Key] = []

    def __contains__(self, key: Key) -> bool:
        return key in self.held

    @property
    def usage(self) -> float:
        """Fraction of slots holding or being written."""
        return (len(self.held) + len(self.storing)) / self.num_slots

    def slot(self, key: Key) -> int | None:
        """The slot holding `key` (readable), or None."""
        return self.held.get(key)

    def touch(self, keys: Iterable[Key]) -> None:
        """These held blocks were used: last to be evicted."""
        for key in keys:
            if key in self.held:
                self.held.move_to_end(key)

    def reserve(self, key: Key) -> int | None:
        """A slot to write `key` into, now `storing`; None when the tier holds or is writing
        it already, or every slot is being written or read."""
        if key in self.held or key in self.storing:
            self.touch([key])
            return None
        slot = self.free.pop() if self.free else self._evict()
        if slot is not None:
            self.storing[key] = slot
        return slot

    def _evict(self) -> int | None:
        for key, slot in self.held.items():
            if not self.readers[slot]:
                del self.held[key]
                self._removed([key])
                return slot
        return None

    def stored(self, key: Key, ok: bool) -> None:
        """The write of `key` ended: held if it succeeded, its slot free otherwise."""
        slot = self.storing.pop(key, None)
        if slot is None:
            return  # the tier was cleared meanwhile
        if ok:
            self.held[key] = slot
            if self.record:
                self.added.append(key)
        else:
            self.free.append(slot)

    def drop(self, key: Key) -> None:
        """Forget a held block (it failed its checksum): its slot is free again once no
        load reads it."""
        slot = self.held.pop(key, None)
        if slot is not None:
            self._removed([key])
            if self.readers[slot]:
                self.dropped.add(slot)
            else:
                self.free.append(slot)

    def begin_read(self, slots: Iterable[int]) -> None:
        self.readers.update(slots)

    def end_read(self, slots: Iterable[int]) -> None:
        for slot in slots:
            self.readers[slot] -= 1
            if self.readers[slot] <= 0:
                del self.readers[slot]
                if slot in self.dropped:
                    self.dropped.discard(slot)
                    self.free.append(slot)

    def clear(self) -> None:
        """The tier is gone: it holds nothing (its blocks count as removed)."""
        self._removed(list(self.held))
        self.held.clear()
        self.storing.clear()
        self.readers.clear()
        self.dropped.clear()
        self.free = []

    def _removed(self, keys: list[Key]) -> None:
        if self.record:
            self.removed += keys

    def take_removed(self) -> list[Key]:
        removed, self.removed = self.removed, []
        return removed

    def take_added(self) -> list[Key]:
        added, self.added = self.added, []
        return added
