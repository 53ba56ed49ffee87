"""TierIndex: slots by key, LRU eviction that spares blocks being read, and the
accounting of every slot (free, storing, held) checked against a brute-force model."""

from __future__ import annotations

import random

import pytest

from pd.kv_offload.index import TierIndex


def key(i: int) -> tuple[bytes, int]:
    return (i.to_bytes(32, "big"), 0)


def test_a_full_tier_evicts_its_least_recently_used_block_and_records_it():
    index = TierIndex("disk", 2)
    for i in (1, 2):
        index.stored(key(i), ok=index.reserve(key(i)) is not None)
    index.touch([key(1)])  # 2 is now the oldest
    slot = index.reserve(key(3))
    assert slot is not None and key(2) not in index and key(1) in index
    assert index.take_removed() == [key(2)] and index.take_added() == [key(1), key(2)]


def test_a_block_being_read_is_not_evicted_and_a_tier_all_read_takes_no_store():
    index = TierIndex("disk", 1)
    index.stored(key(1), ok=index.reserve(key(1)) is not None)
    index.begin_read([index.slot(key(1))])
    assert index.reserve(key(2)) is None and key(1) in index
    index.end_read([0])
    assert index.reserve(key(2)) == 0 and key(1) not in index


def test_a_failed_store_frees_its_slot_and_holds_nothing():
    index = TierIndex("disk", 1)
    slot = index.reserve(key(1))
    assert index.slot(key(1)) is None  # not readable while written
    index.stored(key(1), ok=False)
    assert key(1) not in index and index.reserve(key(2)) == slot


def test_a_block_dropped_while_read_frees_its_slot_when_the_read_ends():
    index = TierIndex("disk", 1)
    index.stored(key(1), ok=index.reserve(key(1)) is not None)
    index.begin_read([0])
    index.drop(key(1))
    assert key(1) not in index and index.reserve(key(2)) is None
    index.end_read([0])
    assert index.reserve(key(2)) == 0


def test_entries_restored_at_start_are_held_and_their_slots_taken():
    index = TierIndex("disk", 3, [(key(1), 2), (key(2), 0)])
    assert index.slot(key(1)) == 2 and index.slot(key(2)) == 0
    assert index.reserve(key(3)) == 1
    with pytest.raises(ValueError):
        TierIndex("disk", 2, [(key(1), 5)])


@pytest.mark.parametrize("seed", range(20))
def test_every_slot_is_in_exactly_one_state_through_random_operations(seed):
    rng = random.Random(seed)
    index = TierIndex("disk", 4)
    reads: list[int] = []
    for _ in range(300):
        op, k = rng.randrange(5), key(rng.randrange(10))
        if op == 0 and (slot := index.reserve(k)) is not None:
            assert slot not in index.held.values()
        elif op == 1 and k in index.storing:
            index.stored(k, ok=rng.random() < 0.8)
        elif op == 2 and (slot := index.slot(k)) is not None:
            index.begin_read([slot])
            reads.append(slot)
        elif op == 3 and reads:
            index.end_read([reads.pop(rng.randrange(len(reads)))])
        elif op == 4:
            index.drop(k)
        states = [*index.free, *index.held.values(), *index.storing.values(), *index.dropped]
        assert sorted(states) == list(range(4)), states  # each slot once, none lost
