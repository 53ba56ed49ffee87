"""The block pool: every KV block, its ref count, the free queue and the prefix-cache map.

Invariants (`check_integrity` asserts all of them):
- Block 0 is the null block: never free, never cached, never ref-counted. Block tables use
  it for positions a group no longer needs (out of the window, behind the Mamba state).
- Every other block is either in the free queue with ref_cnt 0, or out of it with
  ref_cnt > 0 equal to the number of request block lists holding it.
- A block with a hash is in the map under exactly (hash, group id), and the map holds
  nothing else. A free block may keep its hash: it is a cached block that can still be hit
  until it is evicted, which happens when it is popped for a new allocation.

Eviction order: a freed block without a hash goes to the front of the free queue (reused
first: it caches nothing); a freed cached block goes to the back. So new allocations take
uncached blocks first, then evict cached blocks least recently freed first (LRU).

With `record_events`, every change to the prefix cache is recorded as a KV event
(kv_events/messages.py: blocks stored, evicted, all cleared) until `take_events`.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Iterator, NamedTuple, Sequence

from kv_events.hashing import BlockHash
from kv_events.messages import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class BlockHashWithGroupId(NamedTuple):
    block_hash: BlockHash
    group_id: int


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHashWithGroupId | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) pop, push at either end and removal
    from the middle (a cached free block that gets hit leaves the queue)."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free block")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert(block, self._head, self._head.next_free)

    def _insert(self, block: KVCacheBlock, before: KVCacheBlock, after: KVCacheBlock) -> None:
        block.prev_free, block.next_free = before, after
        before.next_free = after.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """All blocks of the KV cache, shared by every group."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, record_events: bool = False,
                 block_sizes: Sequence[int] = ()) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.record_events = record_events
        self.block_sizes = list(block_sizes)  # per group: the tokens a stored event's block covers
        self._events: list[KVEvent] = []
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[BlockHashWithGroupId, KVCacheBlock] = {}
        # when a list: every block entered in the map, with its key (an offload tier copies them)
        self.cache_log: list[tuple[KVCacheBlock, BlockHashWithGroupId]] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(
        self, block_hash: BlockHash, group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """The cached block of each group for this hash, or None unless all groups have one."""
        blocks = []
        for group_id in group_ids:
            block = self.cached.get(BlockHashWithGroupId(block_hash, group_id))
            if block is None:
                return None
            blocks.append(block)
        return blocks

    def cache_full_blocks(
        self,
        block_hashes: Sequence[BlockHash],
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: int,
    ) -> None:
        """Enter blocks[num_cached_blocks:num_full_blocks] (full, held by a request) in the
        map. Null blocks and blocks already cached are left alone; when another block
        already holds the same hash, this one stays uncached (the first one serves hits).
        A no-op when caching is disabled."""
        if not self.enable_caching:
            return
        stored: list[int] = []  # indices entered now
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null or block.block_hash is not None:
                continue
            key = BlockHashWithGroupId(block_hashes[i], group_id)
            if key not in self.cached:
                block.block_hash = key
                self.cached[key] = block
                stored.append(i)
                if self.cache_log is not None:
                    self.cache_log.append((block, key))
        if self.record_events and stored:
            self._record_stored(block_hashes, stored, group_id)

    def _record_stored(self, block_hashes: Sequence[BlockHash], stored: list[int], group_id: int) -> None:
        """One event per run of consecutive blocks entered (their parent named)."""
        start = 0
        for k in range(1, len(stored) + 1):
            if k == len(stored) or stored[k] != stored[k - 1] + 1:
                first, last = stored[start], stored[k - 1]
                self._events.append(BlockStored(
                    block_hashes=list(block_hashes[first:last + 1]),
                    parent_hash=block_hashes[first - 1] if first else None,
                    token_count=(last + 1 - first) * self._block_size(group_id), group=group_id))
                start = k

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` free blocks (evicting their cache entries), each with ref_cnt 1."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks, {self.num_free_blocks} are free")
        blocks = [self.free_queue.popleft() for _ in range(num_blocks)]
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            if self.record_events:
                self._events.append(BlockRemoved([block.block_hash.block_hash], block.block_hash.group_id))
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit); a free cached
        block leaves the free queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; a block reaching 0 becomes free. Cached
        blocks are queued for eviction in the order given (pass the ones to evict first
        first); uncached ones go to the front, to be reused before any cached block."""
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only possible when no block is held. Returns
        whether it was done."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.record_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """The KV events recorded since the last call (none unless `record_events`)."""
        events, self._events = self._events, []
        return events

    def cached_events(self) -> list[KVEvent]:
        """Every block cached now, as events that store them (parents not named)."""
        by_group: dict[int, list[BlockHash]] = {}
        for key in self.cached:
            by_group.setdefault(key.group_id, []).append(key.block_hash)
        return [BlockStored(hashes, None, len(hashes) * self._block_size(group), group)
                for group, hashes in sorted(by_group.items())]

    def _block_size(self, group_id: int) -> int:
        return self.block_sizes[group_id] if group_id < len(self.block_sizes) else 0

    def check_integrity(self, held: Counter[int] | None = None) -> None:
        """Assert every invariant of the module docstring. `held` counts, per block id,
        the request block lists holding it; when given, ref counts must equal it."""
        null = self.null_block
        assert null.ref_cnt == 0 and null.block_hash is None and null.prev_free is None
        free_ids = [b.block_id for b in self.free_queue]
        assert len(free_ids) == len(set(free_ids)) == self.num_free_blocks, "free queue corrupt"
        free = set(free_ids)
        assert 0 not in free, "null block in free queue"
        for block in self.blocks[1:]:
            in_queue = block.block_id in free
            assert in_queue == (block.ref_cnt == 0), f"{block}: in free queue={in_queue}"
            assert block.ref_cnt >= 0, f"{block}: negative ref count"
            if held is not None:
                assert block.ref_cnt == held.get(block.block_id, 0), (
                    f"{block}: ref_cnt != {held.get(block.block_id, 0)} holders"
                )
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, f"{block}: hash not mapped"
        for key, block in self.cached.items():
            assert block.block_hash == key, f"map entry {key} points to {block}"
        if not self.enable_caching:
            assert not self.cached, "blocks cached with caching disabled"
