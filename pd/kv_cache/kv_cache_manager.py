"""KVCacheManager: the scheduler's one door into the KV cache.

The scheduler pairs the calls: `get_computed_blocks` (the prefix-cache hit, no side
effect but statistics) then `allocate_slots` (takes the hit and new blocks, or returns
None and takes nothing when the pool is short); after the step has written the KV,
`cache_blocks` enters the request's now-full blocks in the prefix cache; `free` when a
request ends or is preempted. Block ids leave as `list[list[int]]`, KV cache groups outer.

A block enters the prefix cache only once its data is written (never at allocation):
otherwise a request scheduled in the same step could hit a Mamba state not yet computed,
or a decode server could serve hits on blocks whose remote KV has not landed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pd.kv_cache.block_pool import KVCacheBlock
from pd.kv_cache.cached_request import CachedRequest
from pd.kv_cache.coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    NoPrefixCacheCoordinator,
    UnitaryKVCacheCoordinator,
)
from pd.kv_cache.spec import FullAttentionSpec, KVCacheConfig, MambaSpec, SlidingWindowSpec, cdiv


@dataclass(frozen=True)
class KVCacheBlocks:
    """Blocks per KV cache group (outer tuple = groups)."""

    blocks: tuple[list[KVCacheBlock], ...]

    def get_block_ids(self) -> list[list[int]]:
        return [[b.block_id for b in group] for group in self.blocks]

    def get_unfilled_block_ids(self) -> list[list[int]]:
        """Positional block ids per group with 0 where the block is the null block or a
        prefix-cache entry: what is left are the blocks whose contents nobody has
        written yet (what a connector must load)."""
        return [[0 if b.is_null or b.block_hash is not None else b.block_id for b in group]
                for group in self.blocks]

    @property
    def num_blocks(self) -> int:
        return sum(len(group) for group in self.blocks)


@dataclass
class PrefixCacheStats:
    """Counts in tokens: `queries` are tokens looked up, `hits` tokens found. Per group,
    a hit is what that group's type found on its own before the hybrid reduction, so a
    collapsing group shows as a low per-group rate next to a high one."""

    num_groups: int
    requests: int = 0
    queries: int = 0
    hits: int = 0
    group_queries: list[int] = field(init=False)
    group_hits: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.group_queries = [0] * self.num_groups
        self.group_hits = [0] * self.num_groups

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(
        self,
        config: KVCacheConfig,
        enable_caching: bool = True,
        max_model_len: int | None = None,
        record_events: bool = False,
    ) -> None:
        self.config = config
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.coordinator = make_coordinator(config, enable_caching, record_events)
        self.pool = self.coordinator.pool
        # groups that keep only part of a prefix: one Mamba state, the last window
        self.partial_prefix_groups = frozenset(
            i for i, g in enumerate(config.groups) if isinstance(g.spec, (MambaSpec, SlidingWindowSpec)))
        self.stats = PrefixCacheStats(num_groups=len(config.groups))
        self._lookups: dict[str, tuple[int, int, tuple[int | None, ...]]] = {}  # the last, until its hit is taken
        self.pinned: Counter[int] = Counter()  # block id -> references held by `pin`

    def pin(self, block: KVCacheBlock) -> None:
        """Hold one reference on a block outside any request (an offload tier copying it):
        it is not evicted until `unpin`."""
        self.pool.touch([block])
        self.pinned[block.block_id] += 1

    def unpin(self, block: KVCacheBlock) -> None:
        self.pool.free_blocks([block])
        self.pinned[block.block_id] -= 1
        if not self.pinned[block.block_id]:
            del self.pinned[block.block_id]

    @property
    def num_groups(self) -> int:
        return len(self.config.groups)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests, in [0, 1]."""
        return self.pool.usage

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold (every block but the null block)."""
        return self.pool.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def empty_blocks(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in range(self.num_groups)))

    def get_computed_blocks(self, request: CachedRequest,
                            skip_groups: frozenset[int] = frozenset()) -> tuple[KVCacheBlocks, int]:
        """The request's prefix-cache hit: blocks per group and its length in tokens.

        At least one token is always left to compute; a request that scores its prompt
        gets no hit (`CachedRequest.reads_prefix_cache`). `skip_groups` are left out of the
        reduction and get no hit blocks: the scheduler passes `partial_prefix_groups` for
        a request whose KV arrives from a prefill server, which brings what those groups
        need, so their misses do not collapse the full-attention hit to 0.
        The stats count a lookup once, when `allocate_slots` takes its hit: a request that
        waits for room and looks up again every step is one query, not one per step.
        """
        if not (self.enable_caching and request.reads_prefix_cache):
            return self.empty_blocks(), 0
        hit = self.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1, skip_groups)
        self._lookups[request.request_id] = (request.num_tokens, hit.num_tokens, hit.group_hit_tokens)
        return KVCacheBlocks(hit.blocks), hit.num_tokens

    def _record(self, num_tokens: int, hit_tokens: int, group_hits: tuple[int | None, ...]) -> None:
        stats = self.stats
        stats.requests += 1
        stats.queries += num_tokens
        stats.hits += hit_tokens
        for group_id, group_hit in enumerate(group_hits):
            if group_hit is not None:
                stats.group_queries[group_id] += num_tokens
                stats.group_hits[group_id] += group_hit

    def growth_blocks(self, num_tokens: int) -> int:
        """Blocks a request takes to grow by `num_tokens` tokens (at most: a new block per
        block_size tokens of each full-attention group; sliding windows and Mamba states
        do not grow)."""
        return sum(cdiv(num_tokens, g.spec.block_size) + 1 for g in self.config.groups
                   if type(g.spec) is FullAttentionSpec) if num_tokens > 0 else 0

    def num_blocks_to_allocate(self, request: CachedRequest, num_new_tokens: int, num_new_computed_tokens: int = 0,
                               new_computed_blocks: KVCacheBlocks | None = None,
                               num_external_computed_tokens: int = 0) -> int:
        """What `allocate_slots` with these arguments would take from the pool (no side effect)."""
        hit = new_computed_blocks.blocks if new_computed_blocks else self.empty_blocks().blocks
        num_computed = request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
        return self.coordinator.get_num_blocks_to_allocate(request.request_id, num_computed + num_new_tokens, hit,
                                                           num_computed)

    def allocate_slots(
        self,
        request: CachedRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_external_computed_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Blocks for `num_new_tokens` more tokens of `request`; None if the pool is short,
        in which case it took no block.

        `new_computed_blocks` / `num_new_computed_tokens` are the hit from
        `get_computed_blocks` (new requests only). `num_external_computed_tokens` arrive
        from a connector: they get blocks but are not computed here, and positions already
        out of reach after them (old window blocks, old Mamba states) get null blocks.
        """
        if num_new_tokens < 0 or num_external_computed_tokens < 0:
            raise ValueError("token counts must be non-negative")
        hit = new_computed_blocks.blocks if new_computed_blocks else self.empty_blocks().blocks
        request_id = request.request_id
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_computed += num_external_computed_tokens
        num_tokens = num_computed + num_new_tokens
        if self.max_model_len is not None and num_tokens > self.max_model_len:
            raise ValueError(
                f"request {request_id!r} would hold {num_tokens} tokens, past "
                f"max_model_len={self.max_model_len}"
            )
        coordinator = self.coordinator
        coordinator.remove_skipped_blocks(request_id, request.num_computed_tokens)
        needed = coordinator.get_num_blocks_to_allocate(request_id, num_tokens, hit, num_computed)
        if needed > self.pool.num_free_blocks:
            return None
        coordinator.save_new_computed_blocks(request_id, hit)
        if new_computed_blocks is not None and (lookup := self._lookups.pop(request_id, None)) is not None:
            self._record(*lookup)
        new_blocks = coordinator.allocate_new_blocks(request_id, num_tokens, num_computed)
        return KVCacheBlocks(new_blocks)

    def cache_blocks(self, request: CachedRequest, num_computed_tokens: int) -> None:
        """Enter the request's full blocks among its first `num_computed_tokens` tokens in
        the prefix cache. Call after the step that wrote them (or after their remote KV
        landed); blocks already cached are skipped, so calling every step is cheap. A
        request that does not write the prefix cache (`CachedRequest.writes_prefix_cache`)
        enters nothing."""
        if self.enable_caching and request.writes_prefix_cache:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def fork(self, request: CachedRequest, child: CachedRequest) -> list[tuple[int, int]] | None:
        """Give `child` (a new request) the blocks of `request`'s computed tokens, copy on
        write: every full block shared, in every group, and a block of its own for each
        block not full (the last, which `request` goes on writing), whose data must be
        copied before anything writes either: the (source, copy) block ids returned.
        None, taking nothing, when the pool is short of those blocks."""
        num_tokens = request.num_computed_tokens
        if self.coordinator.num_fork_blocks(request.request_id, num_tokens) > self.pool.num_free_blocks:
            return None
        pairs = self.coordinator.fork(request.request_id, child.request_id, num_tokens)
        return [(source.block_id, copy.block_id) for source, copy in pairs]

    def free(self, request: CachedRequest) -> None:
        """Release every block the request holds (tail blocks become evictable first)."""
        self._lookups.pop(request.request_id, None)
        self.coordinator.free(request.request_id)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        return self.get_blocks(request_id).get_block_ids()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; refused (False) while any block is held."""
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Assert the pool's invariants, with ref counts equal to the holders counted
        over every group's request block lists, and the pins."""
        held = Counter(
            block.block_id
            for manager in self.coordinator.managers
            for blocks in manager.req_to_blocks.values()
            for block in blocks
            if not block.is_null
        ) + self.pinned
        self.pool.check_integrity(held)


def make_coordinator(config: KVCacheConfig, enable_caching: bool, record_events: bool = False) -> KVCacheCoordinator:
    """The coordinator for the groups; `record_events`: its pool records KV events
    (nothing is ever cached, so recorded, without prefix caching)."""
    if not enable_caching:
        return NoPrefixCacheCoordinator(config)
    if len(config.groups) == 1:
        return UnitaryKVCacheCoordinator(config, record_events)
    return HybridKVCacheCoordinator(config, record_events)
