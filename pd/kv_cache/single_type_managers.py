"""One manager per spec type: which blocks a request holds in one KV cache group.

A request's block list in a group is positional: entry i covers tokens
[i * block_size, (i + 1) * block_size). Entries a group no longer needs are the null
block, and they always form a prefix of the list (what is skipped only grows).

Cache-hit rules, for a hit of L tokens (L a multiple of block_size); the next token to
compute is at position L:
- full attention: every block before L (downward-closed: a hit at L implies all shorter);
- sliding window W: the next token attends to itself and the W-1 tokens before it, so
  the blocks covering positions [L-W+1, L) are needed, clamped at 0;
- Mamba ("align" mode): block L/block_size - 1, which holds the state after L tokens.

The same rules decide which blocks a running request can let go of (`num_skipped_tokens`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

from kv_events.hashing import BlockHash
from pd.kv_cache.block_pool import BlockPool, KVCacheBlock
from pd.kv_cache.cached_request import CachedRequest
from pd.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
)

GroupBlocks = tuple[list[KVCacheBlock], ...]  # one block list per group of a search


class SingleTypeKVCacheManager(ABC):
    """The blocks of one KV cache group, per request."""

    downward_closed = False  # whether a hit at L implies a hit at every shorter length

    def __init__(self, spec: KVCacheSpec, group_id: int, pool: BlockPool) -> None:
        self.spec = spec
        self.group_id = group_id
        self.pool = pool
        self.block_size = spec.block_size
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}

    @classmethod
    @abstractmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        pool: BlockPool,
        spec: KVCacheSpec,
    ) -> GroupBlocks:
        """The longest hit of at most `max_length` tokens valid for every group in
        `group_ids` (all of this spec). Returns one list per group, all of the hit's
        length in blocks, with the null block where a block is not needed."""

    @abstractmethod
    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before this position need no block once `num_computed_tokens` are computed."""

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        return self.num_skipped_tokens(num_computed_tokens) // self.block_size

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_computed_tokens: int,
    ) -> int:
        """Free blocks that `save_new_computed_blocks` + `allocate_new_blocks` will take:
        new blocks, plus hit blocks now sitting in the free queue."""
        num_required = cdiv(num_tokens, self.block_size)
        num_held = len(self.req_to_blocks.get(request_id, ())) + len(new_computed_blocks)
        first_real = max(num_held, self.num_skipped_blocks(num_computed_tokens))
        num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return max(0, num_required - first_real) + num_evictable

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Take a reference on a new request's prefix-cache hit. Called once per admission."""
        if request_id in self.num_cached_blocks:
            assert not new_computed_blocks, "hit blocks for a request already admitted"
            return
        self.pool.touch(new_computed_blocks)
        self.req_to_blocks[request_id] = list(new_computed_blocks)
        self.num_cached_blocks[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_computed_tokens: int
    ) -> list[KVCacheBlock]:
        """Extend the request's list to cover `num_tokens` tokens; positions already
        skippable at `num_computed_tokens` get the null block. Returns the new blocks.
        Called after `save_new_computed_blocks`, which admits the request."""
        blocks = self.req_to_blocks[request_id]
        num_required = cdiv(num_tokens, self.block_size)
        if num_required <= len(blocks):
            return []
        num_null = min(self.num_skipped_blocks(num_computed_tokens), num_required) - len(blocks)
        blocks.extend([self.pool.null_block] * max(0, num_null))
        new_blocks = self.pool.get_new_blocks(num_required - len(blocks))
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: CachedRequest, num_tokens: int) -> None:
        """Enter the request's full blocks among its first `num_tokens` tokens in the cache."""
        num_cached = self.num_cached_blocks[request.request_id]
        num_full = num_tokens // self.block_size
        if num_full <= num_cached:
            return
        self.pool.cache_full_blocks(
            request.block_hashes(self.block_size),
            self.req_to_blocks[request.request_id],
            num_cached,
            num_full,
            self.group_id,
        )
        self.num_cached_blocks[request.request_id] = num_full

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks the request no longer needs, replacing them by the null block."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        removed = []
        for i in range(min(self.num_skipped_blocks(num_computed_tokens), len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:
                break  # nulls form a prefix: everything before is already skipped
            removed.append(blocks[i])
            blocks[i] = self.pool.null_block
        self.pool.free_blocks(removed)

    def num_fork_blocks(self, request_id: str, num_tokens: int) -> int:
        """New blocks `fork` takes: 1 if the request's block holding token `num_tokens - 1`
        is not full (it is written on), else 0."""
        blocks = self.req_to_blocks[request_id]
        full = num_tokens // self.block_size
        return int(num_tokens % self.block_size != 0 and len(blocks) > full and not blocks[full].is_null)

    def fork(self, request_id: str, child_id: str, num_tokens: int) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """Give `child_id` the request's blocks for its first `num_tokens` tokens: the full
        ones shared (one more reference each; nobody writes a full block again), the one
        not full a new block of its own. Returns (source, copy) for the data to copy."""
        blocks = self.req_to_blocks[request_id][:cdiv(num_tokens, self.block_size)]
        full = num_tokens // self.block_size
        shared = blocks[:full]
        self.pool.touch(shared)
        child, copies = list(shared), []
        for block in blocks[full:]:
            if block.is_null:
                child.append(block)
                continue
            copy = self.pool.get_new_blocks(1)[0]
            child.append(copy)
            copies.append((block, copy))
        self.req_to_blocks[child_id] = child
        self.num_cached_blocks[child_id] = min(self.num_cached_blocks[request_id], full)
        return copies

    def free(self, request_id: str) -> list[KVCacheBlock]:
        """Drop the request; returns its blocks in the order to free them (tail first)."""
        self.num_cached_blocks.pop(request_id, None)
        return list(reversed(self.req_to_blocks.pop(request_id, [])))


class FullAttentionManager(SingleTypeKVCacheManager):
    downward_closed = True

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int, group_ids: Sequence[int],
                               pool: BlockPool, spec: KVCacheSpec) -> GroupBlocks:
        hit: GroupBlocks = tuple([] for _ in group_ids)
        for block_hash in block_hashes[: max_length // spec.block_size]:
            blocks = pool.get_cached_block(block_hash, group_ids)
            if blocks is None:
                break
            for group_hit, block in zip(hit, blocks):
                group_hit.append(block)
        return hit

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0


class SlidingWindowManager(SingleTypeKVCacheManager):
    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int, group_ids: Sequence[int],
                               pool: BlockPool, spec: KVCacheSpec) -> GroupBlocks:
        """Scan right to left for the last run of `needed` cached blocks; a run that
        reaches block 0 is a hit even when shorter."""
        needed = cdiv(spec.sliding_window - 1, spec.block_size)
        max_blocks = min(max_length // spec.block_size, len(block_hashes))
        hit: GroupBlocks = tuple([pool.null_block] * max_blocks for _ in group_ids)
        if needed == 0:
            return hit
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            blocks = pool.get_cached_block(block_hashes[i], group_ids)
            if blocks is None:
                run = 0
                continue
            for group_hit, block in zip(hit, blocks):
                group_hit[i] = block
            run += 1
            if run == needed:
                return tuple(group_hit[: i + needed] for group_hit in hit)
        return tuple(group_hit[:run] for group_hit in hit)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.spec.sliding_window + 1)


class MambaManager(SingleTypeKVCacheManager):
    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int, group_ids: Sequence[int],
                               pool: BlockPool, spec: KVCacheSpec) -> GroupBlocks:
        max_blocks = min(max_length // spec.block_size, len(block_hashes))
        for i in range(max_blocks - 1, -1, -1):
            blocks = pool.get_cached_block(block_hashes[i], group_ids)
            if blocks is not None:
                return tuple([pool.null_block] * i + [block] for block in blocks)
        return tuple([] for _ in group_ids)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - 1)


_MANAGERS: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    MambaSpec: MambaManager,
}


def manager_class(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """The manager for a spec's exact type."""
    try:
        return _MANAGERS[type(spec)]
    except KeyError:
        raise TypeError(f"no KV cache manager for {type(spec).__name__}") from None
