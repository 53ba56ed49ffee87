"""Host rows a disk tier moves a GPU engine's blocks through: NIXL's POSIX backend moves host
memory, so a block goes device -> row before its write and row -> device after its read
(each copy in the engine's thread, synchronous; one row holds one block of one group, its
data refs back to back, as the disk's slot does). Pinned where the KV cache is on a GPU."""

from __future__ import annotations

import torch

from pd.kv_cache.canonical import CanonicalKVCaches
from pd.kv_offload.tier import TierBlock

STAGING_BYTES = 256 << 20  # host memory of a GPU engine's disk tier, for the blocks being moved


class Staging:
    def __init__(self, caches: CanonicalKVCaches, slot_bytes: int, nbytes: int = STAGING_BYTES) -> None:
        self.caches = caches
        self.slot_bytes = slot_bytes
        num_rows = max(16, nbytes // slot_bytes)
        on_gpu = caches.tensors[0].device.type == "cuda"
        self.buffer = torch.zeros((num_rows, slot_bytes), dtype=torch.int8, pin_memory=on_gpu)
        self.free = list(range(num_rows - 1, -1, -1))

    def take(self, n: int) -> list[int] | None:
        """`n` rows, or None (and none taken) when fewer are free."""
        if n > len(self.free):
            return None
        return [self.free.pop() for _ in range(n)]

    def give(self, rows: list[int]) -> None:
        self.free.extend(rows)

    def ranges(self, block: TierBlock, row: int) -> list[tuple[int, int]]:
        """Where the block's bytes are in host memory: one range of its row."""
        size = sum(ref.page_size_bytes for ref in self.caches.group_data_refs[block.group])
        return [(self.buffer.data_ptr() + row * self.slot_bytes, size)]

    def to_host(self, blocks: list[TierBlock], rows: list[int]) -> None:
        self._copy(blocks, rows, to_host=True)

    def to_device(self, blocks: list[TierBlock], rows: list[int]) -> None:
        self._copy(blocks, rows, to_host=False)

    def _copy(self, blocks: list[TierBlock], rows: list[int], to_host: bool) -> None:
        for block, row in zip(blocks, rows):
            offset = 0
            for ref in self.caches.group_data_refs[block.group]:
                start, size = ref.offset_bytes, ref.page_size_bytes
                device = self.caches.tensors[ref.tensor_idx].tensor[block.block_id, start:start + size]
                host = self.buffer[row, offset:offset + size]
                (host if to_host else device).copy_(device if to_host else host)
                offset += size
        if self.caches.tensors[0].device.type == "cuda":
            torch.cuda.synchronize(self.caches.tensors[0].device)
