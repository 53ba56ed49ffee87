"""Coordinators: one per KV cache, driving the per-group managers together.

- `NoPrefixCacheCoordinator`: prefix caching off; every lookup misses.
- `UnitaryKVCacheCoordinator`: one group; its manager's search is the answer.
- `HybridKVCacheCoordinator`: any number of groups of any types. The hit is the fixed
  point of DESIGN.md: start from the longest candidate (aligned to the LCM of the block
  sizes), let each spec type accept it or shrink it to its longest valid hit not past it,
  and repeat until no type shrinks it. Every step keeps the candidate at or above the true
  answer (the longest length valid for all types), and a length every type accepts is
  valid, so the fixed point is that answer. Full attention's valid lengths are
  downward-closed, so it is searched once and its blocks trimmed at the end.

Groups can be skipped from the reduction per lookup (`skip_group_ids`): they do not
constrain the hit and get no hit blocks (their data comes from elsewhere: allocation then
gives them null blocks where they need nothing and new blocks where they do).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from kv_events.hashing import BlockHash
from pd.kv_cache.block_pool import BlockPool, KVCacheBlock
from pd.kv_cache.cached_request import CachedRequest
from pd.kv_cache.single_type_managers import GroupBlocks, SingleTypeKVCacheManager, manager_class
from pd.kv_cache.spec import KVCacheConfig, KVCacheSpec

HashesForBlockSize = Callable[[int], Sequence[BlockHash]]


@dataclass(frozen=True)
class CacheHit:
    """A prefix-cache hit: `blocks[g]` for group g (nulls where unneeded), covering
    `num_tokens` tokens. `group_hit_tokens[g]` is the longest hit group g's type found on
    its own, before the reduction (None when the group was skipped)."""

    blocks: tuple[list[KVCacheBlock], ...]
    num_tokens: int
    group_hit_tokens: tuple[int | None, ...]


class KVCacheCoordinator:
    """Fans the per-request operations out to one manager per group."""

    def __init__(self, config: KVCacheConfig, enable_caching: bool, record_events: bool = False) -> None:
        self.config = config
        self.pool = BlockPool(config.num_blocks, enable_caching, record_events, config.block_sizes)
        self.managers: list[SingleTypeKVCacheManager] = [
            manager_class(group.spec)(group.spec, group_id, self.pool)
            for group_id, group in enumerate(config.groups)
        ]

    def find_longest_cache_hit(
        self, hashes: HashesForBlockSize, max_length: int, skip_group_ids: frozenset[int]
    ) -> CacheHit:
        """The longest prefix of at most `max_length` tokens cached for every group not
        in `skip_group_ids`. `hashes(block_size)` gives the request's block hashes."""
        raise NotImplementedError

    def null_hit(self, num_tokens: int, skip_group_ids: frozenset[int]) -> CacheHit:
        """A hit of `num_tokens` tokens made of null blocks only (0 for a miss); skipped
        groups get no blocks."""
        null = self.pool.null_block
        return CacheHit(
            blocks=tuple([] if g in skip_group_ids else [null] * (num_tokens // m.block_size)
                         for g, m in enumerate(self.managers)),
            num_tokens=num_tokens,
            group_hit_tokens=tuple(
                None if g in skip_group_ids else 0 for g in range(len(self.managers))
            ),
        )

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        num_computed_tokens: int,
    ) -> int:
        return sum(
            m.get_num_blocks_to_allocate(request_id, num_tokens, blocks, num_computed_tokens)
            for m, blocks in zip(self.managers, new_computed_blocks)
        )

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[Sequence[KVCacheBlock]]
    ) -> None:
        for manager, blocks in zip(self.managers, new_computed_blocks):
            manager.save_new_computed_blocks(request_id, blocks)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_computed_tokens: int
    ) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            m.allocate_new_blocks(request_id, num_tokens, num_computed_tokens)
            for m in self.managers
        )

    def cache_blocks(self, request: CachedRequest, num_tokens: int) -> None:
        for manager in self.managers:
            manager.cache_blocks(request, num_tokens)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def num_fork_blocks(self, request_id: str, num_tokens: int) -> int:
        return sum(m.num_fork_blocks(request_id, num_tokens) for m in self.managers)

    def fork(self, request_id: str, child_id: str, num_tokens: int) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        return [pair for m in self.managers for pair in m.fork(request_id, child_id, num_tokens)]

    def free(self, request_id: str) -> None:
        self.pool.free_blocks([b for m in self.managers for b in m.free(request_id)])

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.req_to_blocks.get(request_id, []) for m in self.managers)


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    def __init__(self, config: KVCacheConfig) -> None:
        super().__init__(config, enable_caching=False)

    def find_longest_cache_hit(self, hashes: HashesForBlockSize, max_length: int,
                               skip_group_ids: frozenset[int]) -> CacheHit:
        return self.null_hit(0, skip_group_ids)

    def cache_blocks(self, request: CachedRequest, num_tokens: int) -> None:
        pass


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    def __init__(self, config: KVCacheConfig, record_events: bool = False) -> None:
        if len(config.groups) != 1:
            raise ValueError("the unitary coordinator serves exactly one KV cache group")
        super().__init__(config, enable_caching=True, record_events=record_events)

    def find_longest_cache_hit(self, hashes: HashesForBlockSize, max_length: int,
                               skip_group_ids: frozenset[int]) -> CacheHit:
        if 0 in skip_group_ids:
            return self.null_hit(0, skip_group_ids)
        manager = self.managers[0]
        blocks = manager.find_longest_cache_hit(
            hashes(manager.block_size), max_length, [0], self.pool, manager.spec
        )
        num_tokens = len(blocks[0]) * manager.block_size
        return CacheHit(blocks, num_tokens, (num_tokens,))


@dataclass(frozen=True)
class _SpecType:
    """The groups of one spec, searched together."""

    spec: KVCacheSpec
    group_ids: tuple[int, ...]
    manager: type[SingleTypeKVCacheManager]

    def search(
        self, hashes: HashesForBlockSize, max_length: int, pool: BlockPool
    ) -> tuple[GroupBlocks, int]:
        blocks = self.manager.find_longest_cache_hit(
            hashes(self.spec.block_size), max_length, self.group_ids, pool, self.spec
        )
        return blocks, len(blocks[0]) * self.spec.block_size

    def without(self, skip_group_ids: frozenset[int]) -> _SpecType | None:
        kept = tuple(g for g in self.group_ids if g not in skip_group_ids)
        if len(kept) == len(self.group_ids):
            return self
        return _SpecType(self.spec, kept, self.manager) if kept else None


class HybridKVCacheCoordinator(KVCacheCoordinator):
    def __init__(self, config: KVCacheConfig, record_events: bool = False) -> None:
        super().__init__(config, enable_caching=True, record_events=record_events)
        by_spec: dict[KVCacheSpec, list[int]] = {}
        for group_id, group in enumerate(config.groups):
            by_spec.setdefault(group.spec, []).append(group_id)
        types = [_SpecType(s, tuple(ids), manager_class(s)) for s, ids in by_spec.items()]
        # Downward-closed types first: their one search bounds all the others.
        self.types = sorted(types, key=lambda t: not t.manager.downward_closed)
        self.lcm = math.lcm(*config.block_sizes)

    def find_longest_cache_hit(self, hashes: HashesForBlockSize, max_length: int,
                               skip_group_ids: frozenset[int]) -> CacheHit:
        types = [t for t in (t.without(skip_group_ids) for t in self.types) if t]
        if not types:
            return self.null_hit(0, skip_group_ids)
        candidate = self._align(max_length)
        found = [t.search(hashes, candidate, self.pool) for t in types]
        own_hits = [num_tokens for _, num_tokens in found]
        shrunk = self._align(min(candidate, *own_hits))
        while shrunk != candidate:
            candidate = shrunk
            for i, t in enumerate(types):
                if not t.manager.downward_closed:
                    found[i] = t.search(hashes, shrunk, self.pool)
                    shrunk = self._align(min(shrunk, found[i][1]))
        return self._assemble(types, found, own_hits, candidate, skip_group_ids)

    def _align(self, num_tokens: int) -> int:
        return num_tokens // self.lcm * self.lcm

    def _assemble(self, types: list[_SpecType], found: list[tuple[GroupBlocks, int]], own_hits: list[int],
                  num_tokens: int, skip_group_ids: frozenset[int]) -> CacheHit:
        """Per-group blocks trimmed to the hit; none for skipped groups."""
        hit = self.null_hit(num_tokens, skip_group_ids)
        blocks, group_hits = list(hit.blocks), list(hit.group_hit_tokens)
        for t, (type_blocks, _), own_hit in zip(types, found, own_hits):
            for group_id, group_blocks in zip(t.group_ids, type_blocks):
                blocks[group_id] = group_blocks[: num_tokens // t.spec.block_size]
                group_hits[group_id] = own_hit
        return CacheHit(tuple(blocks), num_tokens, tuple(group_hits))
