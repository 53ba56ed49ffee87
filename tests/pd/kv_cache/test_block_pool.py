"""BlockPool: random operation sequences against a brute-force model, then the
eviction order, the null block and the prefix-cache map case by case."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd.kv_cache.block_pool import BlockHashWithGroupId, BlockPool, KVCacheBlock

HASHES = [bytes([k]) * 4 for k in range(4)]  # a small alphabet: collisions are common
GROUP_IDS = [0, 1, 2]


def key(h: bytes, group_id: int = 0) -> BlockHashWithGroupId:
    return BlockHashWithGroupId(h, group_id)


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def cache(pool: BlockPool, blocks: list[KVCacheBlock], hashes: list[bytes], group_id: int = 0) -> None:
    pool.cache_full_blocks(hashes, blocks, 0, len(blocks), group_id)


# ---------------------------------------------------------------------------
# Random operation sequences against a model
# ---------------------------------------------------------------------------


class PoolModel:
    """What the pool should look like: free queue order, the map, and who holds what."""

    def __init__(self, num_blocks: int) -> None:
        self.free: list[int] = list(range(1, num_blocks))
        self.cached: dict[BlockHashWithGroupId, int] = {}
        self.holders: list[list[int]] = []

    def held(self) -> Counter[int]:
        return Counter(b for holder in self.holders for b in holder)

    def hash_of(self, block_id: int) -> BlockHashWithGroupId | None:
        return next((k for k, b in self.cached.items() if b == block_id), None)

    def allocate(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        self.cached = {k: b for k, b in self.cached.items() if b not in taken}
        self.holders.append(taken)
        return taken

    def cache(self, block_ids: list[int], hashes: list[bytes], start: int, group_id: int) -> None:
        for block_id, h in list(zip(block_ids, hashes))[start:]:
            if self.hash_of(block_id) is None and key(h, group_id) not in self.cached:
                self.cached[key(h, group_id)] = block_id

    def touch(self, block_ids: list[int]) -> None:
        self.free = [b for b in self.free if b not in block_ids]
        self.holders.append(block_ids)

    def release(self, index: int) -> None:
        block_ids = self.holders.pop(index)
        refs = self.held() + Counter(block_ids)
        for block_id in block_ids:
            refs[block_id] -= 1
            if refs[block_id] > 0:
                continue
            if self.hash_of(block_id) is None:
                self.free.insert(0, block_id)
            else:
                self.free.append(block_id)


def assert_matches(pool: BlockPool, model: PoolModel) -> None:
    pool.check_integrity(model.held())
    assert free_ids(pool) == model.free
    assert {k: b.block_id for k, b in pool.cached.items()} == model.cached


def op(kind: str, *args: st.SearchStrategy) -> st.SearchStrategy:
    return st.tuples(st.just(kind), *args)


INDEX = st.integers(0, 50)  # picks a holder or a cached key, modulo their number
OPS = st.sampled_from(["alloc"] * 3 + ["cache"] * 3 + ["touch"] * 2 + ["free"] * 3 + ["reset"]).flatmap(
    lambda kind: {
        "alloc": op("alloc", st.integers(0, 4)),
        "cache": op(
            "cache",
            INDEX,
            st.lists(st.sampled_from(HASHES), min_size=8, max_size=8),
            st.integers(0, 2),  # num_cached_blocks
            st.sampled_from(GROUP_IDS),
        ),
        "touch": op("touch", INDEX, st.sampled_from(HASHES), st.sampled_from([[], [0], [1], [2]])),
        "free": op("free", INDEX),
        "reset": op("reset"),
    }[kind]
)


def do_alloc(pool: BlockPool, model: PoolModel, n: int) -> None:
    if n > pool.num_free_blocks:
        before = free_ids(pool)
        with pytest.raises(ValueError):
            pool.get_new_blocks(n)
        assert free_ids(pool) == before
        return
    blocks = pool.get_new_blocks(n)
    assert ids(blocks) == model.allocate(n)
    assert all(b.ref_cnt == 1 and b.block_hash is None for b in blocks)


def do_cache(
    pool: BlockPool, model: PoolModel, index: int, hashes: list[bytes], start: int, group_id: int
) -> None:
    if not model.holders:
        return
    block_ids = model.holders[index % len(model.holders)]
    start %= len(block_ids) + 1
    pool.cache_full_blocks(hashes, [pool.blocks[b] for b in block_ids], start, len(block_ids), group_id)
    model.cache(block_ids, hashes, start, group_id)


def do_touch(pool: BlockPool, model: PoolModel, index: int, h: bytes, more_groups: list[int]) -> None:
    """A prefix hit on a cached key (when there is one) looked up in its group and maybe another."""
    group_ids = [0]
    if model.cached:
        h, group_id = sorted(model.cached)[index % len(model.cached)]
        group_ids = [group_id]
    group_ids = sorted(set(group_ids + more_groups))
    hit = pool.get_cached_block(h, group_ids)
    expected = [model.cached.get(key(h, g)) for g in group_ids]
    if None in expected:
        assert hit is None
        return
    assert ids(hit) == expected
    pool.touch(hit)
    model.touch(expected)


def do_free(pool: BlockPool, model: PoolModel, index: int) -> None:
    if not model.holders:
        return
    index %= len(model.holders)
    pool.free_blocks([pool.blocks[b] for b in model.holders[index]])
    model.release(index)


def do_reset(pool: BlockPool, model: PoolModel) -> None:
    done = pool.reset_prefix_cache()
    assert done == (not model.held())
    if done:
        model.cached.clear()


APPLY = {"alloc": do_alloc, "cache": do_cache, "touch": do_touch, "free": do_free, "reset": do_reset}


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(2, 20), ops=st.lists(OPS, min_size=10, max_size=60))
def test_random_operations_keep_every_invariant(num_blocks: int, ops: list[tuple]) -> None:
    pool = BlockPool(num_blocks=num_blocks, enable_caching=True)
    model = PoolModel(num_blocks)
    assert_matches(pool, model)
    for kind, *args in ops:
        APPLY[kind](pool, model, *args)
        assert_matches(pool, model)
    while model.holders:
        do_free(pool, model, 0)
        assert_matches(pool, model)
    assert pool.num_free_blocks == num_blocks - 1
    assert pool.usage == 0


# ---------------------------------------------------------------------------
# check_integrity can fail
# ---------------------------------------------------------------------------


def _pool_with_held_and_cached() -> tuple[BlockPool, Counter[int]]:
    """Blocks 1-2 held and cached, 3 held uncached, 4 free and cached, 5 free."""
    pool = BlockPool(num_blocks=6)
    blocks = pool.get_new_blocks(4)
    cache(pool, blocks, HASHES)
    pool.free_blocks([blocks[3]])
    pool.check_integrity(Counter({1: 1, 2: 1, 3: 1}))
    return pool, Counter({1: 1, 2: 1, 3: 1})


CORRUPTIONS = {
    "held block ref bumped": lambda pool: setattr(pool.blocks[1], "ref_cnt", 2),
    "free block ref bumped": lambda pool: setattr(pool.blocks[5], "ref_cnt", 1),
    "null block ref bumped": lambda pool: setattr(pool.null_block, "ref_cnt", 1),
    "map entry to another block": lambda pool: pool.cached.update({key(HASHES[0]): pool.blocks[2]}),
    "map entry to an uncached block": lambda pool: pool.cached.update({key(HASHES[0], 2): pool.blocks[3]}),
    "hash without map entry": lambda pool: setattr(pool.blocks[3], "block_hash", key(HASHES[3], 1)),
    "map entry dropped": lambda pool: pool.cached.pop(key(HASHES[1])),
    "free block dequeued": lambda pool: pool.free_queue.remove(pool.blocks[5]),
    "held block enqueued": lambda pool: pool.free_queue.append(pool.blocks[3]),
    "null block enqueued": lambda pool: pool.free_queue.append(pool.null_block),
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_check_integrity_catches_corruption(corrupt) -> None:
    pool, held = _pool_with_held_and_cached()
    corrupt(pool)
    with pytest.raises(AssertionError):
        pool.check_integrity(held)


def test_check_integrity_catches_a_wrong_holder_count() -> None:
    pool, held = _pool_with_held_and_cached()
    held[2] += 1
    with pytest.raises(AssertionError):
        pool.check_integrity(held)
    with pytest.raises(AssertionError):
        pool.check_integrity(Counter({1: 1, 2: 1, 3: 1, 4: 1}))


def test_check_integrity_catches_a_cached_block_with_caching_disabled() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.check_integrity(Counter({1: 1}))
    blocks[0].block_hash = key(HASHES[0])
    pool.cached[key(HASHES[0])] = blocks[0]
    with pytest.raises(AssertionError):
        pool.check_integrity(Counter({1: 1}))


# ---------------------------------------------------------------------------
# Eviction order
# ---------------------------------------------------------------------------


def test_fresh_pool_hands_out_blocks_in_id_order_without_the_null_block() -> None:
    pool = BlockPool(num_blocks=5)
    assert pool.num_free_blocks == 4 and pool.usage == 0
    assert ids(pool.get_new_blocks(4)) == [1, 2, 3, 4]
    assert pool.usage == 1
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_uncached_freed_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(num_blocks=5)
    a, b, c, d = pool.get_new_blocks(4)
    cache(pool, [a, b], HASHES[:2])
    pool.free_blocks([a, b, c])
    assert free_ids(pool) == [c.block_id, a.block_id, b.block_id]
    assert pool.get_new_blocks(1) == [c]
    assert pool.get_cached_block(HASHES[0], [0]) == [a]
    assert pool.get_cached_block(HASHES[1], [0]) == [b]


def test_uncached_block_freed_later_still_goes_before_cached_ones() -> None:
    pool = BlockPool(num_blocks=4)
    a, b, c = pool.get_new_blocks(3)
    cache(pool, [a, b], HASHES[:2])
    pool.free_blocks([a, b])
    pool.free_blocks([c])
    assert pool.get_new_blocks(1) == [c]


def test_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(num_blocks=5)
    a1, a2, b1, b2 = pool.get_new_blocks(4)
    cache(pool, [a1, a2], HASHES[:2])
    cache(pool, [b1, b2], HASHES[2:])
    pool.free_blocks([a1, a2])  # request A finishes first
    pool.free_blocks([b1, b2])
    assert pool.get_new_blocks(2) == [a1, a2]
    assert pool.get_cached_block(HASHES[0], [0]) is None
    assert pool.get_cached_block(HASHES[2], [0]) == [b1]
    assert pool.get_new_blocks(1) == [b1]
    assert pool.get_cached_block(HASHES[3], [0]) == [b2]
    pool.check_integrity(Counter({a1.block_id: 1, a2.block_id: 1, b1.block_id: 1}))


def test_freeing_refreshes_lru_position_of_a_hit_block() -> None:
    pool = BlockPool(num_blocks=3)
    a, b = pool.get_new_blocks(2)
    cache(pool, [a, b], HASHES[:2])
    pool.free_blocks([a])
    pool.free_blocks([b])
    pool.touch([a])  # a prefix hit, then freed again: now the most recently freed
    pool.free_blocks([a])
    assert pool.get_new_blocks(1) == [b]


def test_get_new_blocks_evicts_the_cache_entry() -> None:
    pool = BlockPool(num_blocks=2)
    (a,) = pool.get_new_blocks(1)
    cache(pool, [a], [HASHES[0]], group_id=1)
    assert a.block_hash == key(HASHES[0], 1)
    pool.free_blocks([a])
    assert pool.get_cached_block(HASHES[0], [1]) == [a]  # a free block can still be hit
    assert pool.get_new_blocks(1) == [a]
    assert a.block_hash is None and a.ref_cnt == 1
    assert pool.cached == {}
    assert pool.get_cached_block(HASHES[0], [1]) is None
    pool.check_integrity(Counter({a.block_id: 1}))


def test_touching_a_cached_free_block_takes_it_out_of_the_free_queue() -> None:
    pool = BlockPool(num_blocks=4)
    a, b, c = pool.get_new_blocks(3)
    cache(pool, [a], [HASHES[0]])
    pool.free_blocks([a, b, c])
    hit = pool.get_cached_block(HASHES[0], [0])
    pool.touch(hit)
    assert a.ref_cnt == 1 and a.block_hash == key(HASHES[0])
    assert a.block_id not in free_ids(pool) and pool.num_free_blocks == 2
    assert a not in pool.get_new_blocks(2)
    pool.check_integrity(Counter({a.block_id: 1, b.block_id: 1, c.block_id: 1}))


def test_touching_a_held_block_adds_a_reference() -> None:
    pool = BlockPool(num_blocks=3)
    (a,) = pool.get_new_blocks(1)
    cache(pool, [a], [HASHES[0]])
    pool.touch([a])
    assert a.ref_cnt == 2 and pool.num_free_blocks == 1
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([a])
    assert pool.num_free_blocks == 2


def test_double_free_raises() -> None:
    pool = BlockPool(num_blocks=3)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([a])
    pool.check_integrity(Counter())


def test_freeing_a_block_twice_in_one_call_raises() -> None:
    pool = BlockPool(num_blocks=3)
    (a,) = pool.get_new_blocks(1)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([a, a])


def test_null_block_is_never_handed_out_freed_touched_or_cached() -> None:
    pool = BlockPool(num_blocks=4)
    null = pool.null_block
    assert null.block_id == 0 and null.is_null
    pool.free_blocks([null, null])
    pool.touch([null])
    cache(pool, [null], [HASHES[0]])
    assert null.ref_cnt == 0 and null.block_hash is None and pool.cached == {}
    assert null not in pool.free_queue
    assert 0 not in ids(pool.get_new_blocks(3))
    pool.check_integrity(Counter({1: 1, 2: 1, 3: 1}))


def test_pool_needs_a_usable_block() -> None:
    with pytest.raises(ValueError):
        BlockPool(num_blocks=1)


# ---------------------------------------------------------------------------
# The prefix-cache map
# ---------------------------------------------------------------------------


def test_cache_full_blocks_caches_only_the_requested_range() -> None:
    pool = BlockPool(num_blocks=5)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(HASHES, blocks, 1, 3, group_id=2)
    assert [b.block_hash for b in blocks] == [None, key(HASHES[1], 2), key(HASHES[2], 2), None]
    assert set(pool.cached) == {key(HASHES[1], 2), key(HASHES[2], 2)}


def test_cache_full_blocks_with_a_mapped_hash_leaves_the_block_uncached() -> None:
    pool = BlockPool(num_blocks=3)
    first, second = pool.get_new_blocks(2)
    cache(pool, [first], [HASHES[0]])
    cache(pool, [second], [HASHES[0]])
    assert second.block_hash is None
    assert pool.cached == {key(HASHES[0]): first}
    assert pool.get_cached_block(HASHES[0], [0]) == [first]
    pool.free_blocks([second, first])
    assert free_ids(pool) == [second.block_id, first.block_id]  # second caches nothing
    pool.check_integrity(Counter())


def test_a_cached_block_keeps_its_first_hash() -> None:
    pool = BlockPool(num_blocks=2)
    (a,) = pool.get_new_blocks(1)
    cache(pool, [a], [HASHES[0]])
    cache(pool, [a], [HASHES[1]], group_id=1)
    assert a.block_hash == key(HASHES[0])
    assert pool.cached == {key(HASHES[0]): a}


def test_same_hash_in_different_groups_maps_different_blocks() -> None:
    pool = BlockPool(num_blocks=4)
    a, b, c = pool.get_new_blocks(3)
    cache(pool, [a], [HASHES[0]], group_id=0)
    cache(pool, [b], [HASHES[0]], group_id=2)
    assert pool.get_cached_block(HASHES[0], [0, 2]) == [a, b]
    assert pool.get_cached_block(HASHES[0], [2, 0]) == [b, a]
    assert pool.get_cached_block(HASHES[0], [0, 1]) is None  # group 1 has no such block
    assert pool.get_cached_block(HASHES[1], [0]) is None


def test_reset_prefix_cache_refuses_while_a_block_is_held() -> None:
    pool = BlockPool(num_blocks=4)
    a, b = pool.get_new_blocks(2)
    cache(pool, [a, b], HASHES[:2])
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(HASHES[0], [0]) == [a]
    assert b.block_hash == key(HASHES[1])
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {}
    assert all(block.block_hash is None for block in pool.blocks)
    assert pool.get_cached_block(HASHES[0], [0]) is None
    pool.check_integrity(Counter())


def test_pool_with_caching_disabled_caches_nothing() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    cache(pool, [a], [HASHES[0]])
    assert a.block_hash is None
    assert pool.get_cached_block(HASHES[0], [0]) is None
    pool.check_integrity(Counter({a.block_id: 1}))


# ---------------------------------------------------------------------------
# KV events
# ---------------------------------------------------------------------------


def test_events_name_runs_of_stored_blocks_with_their_parent_and_tokens() -> None:
    from kv_events.messages import AllBlocksCleared, BlockRemoved, BlockStored

    pool = BlockPool(12, record_events=True, block_sizes=[16, 32])
    hashes = [bytes([k]) * 32 for k in range(6)]
    blocks = pool.get_new_blocks(6)
    pool.cache_full_blocks(hashes, blocks, 0, 2, 1)
    other = pool.get_new_blocks(1)
    pool.cache_full_blocks([hashes[2]], other, 0, 1, 1)  # another block takes hash 2 first
    pool.cache_full_blocks(hashes, blocks, 2, 6, 1)  # so block 2 stays uncached: the run is 3..5
    assert pool.take_events() == [BlockStored(hashes[:2], None, 64, 1), BlockStored(hashes[2:3], None, 32, 1),
                                  BlockStored(hashes[3:6], hashes[2], 96, 1)]
    pool.free_blocks(blocks)
    pool.get_new_blocks(pool.num_free_blocks)  # evicts every cached block it takes
    removed = pool.take_events()
    assert all(isinstance(e, BlockRemoved) and e.group == 1 for e in removed)
    assert pool.take_events() == []
    fresh = BlockPool(4, record_events=True)
    assert fresh.reset_prefix_cache() and fresh.take_events() == [AllBlocksCleared()]
    quiet = BlockPool(4)
    cache(quiet, quiet.get_new_blocks(2), hashes[:2])
    assert quiet.take_events() == []


def test_cached_events_are_a_snapshot_of_the_map() -> None:
    from kv_events.messages import BlockStored

    pool = BlockPool(8, block_sizes=[16, 16])
    hashes = [bytes([k]) * 32 for k in range(3)]
    cache(pool, pool.get_new_blocks(2), hashes[:2], group_id=0)
    cache(pool, pool.get_new_blocks(1), hashes[2:], group_id=1)
    assert pool.cached_events() == [BlockStored(hashes[:2], None, 32, 0), BlockStored(hashes[2:], None, 16, 1)]
