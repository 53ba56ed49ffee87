"""tier_hit: the longest prefix the tier can add past a device hit, per group type,
against a brute force over every length."""

from __future__ import annotations

import random

import pytest

from pd.kv_cache.block_pool import BlockPool
from pd.kv_cache.single_type_managers import FullAttentionManager, MambaManager, SlidingWindowManager
from pd.kv_cache.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from pd.kv_offload.lookup import tier_hit


def managers(kinds: str, block_size: int = 4):
    pool = BlockPool(8)
    made = []
    for group, kind in enumerate(kinds):
        attention = dict(block_size=block_size, num_kv_heads=1, head_size=4, dtype="float32")
        if kind == "f":
            made.append(FullAttentionManager(FullAttentionSpec(**attention), group, pool))
        elif kind == "s":
            made.append(SlidingWindowManager(SlidingWindowSpec(**attention, sliding_window=6), group, pool))
        else:
            made.append(MambaManager(MambaSpec(block_size=block_size, num_heads=1, head_dim=2, state_size=2,
                                               n_groups=1, conv_width=3, conv_dtype="float32", ssm_dtype="float32"),
                                     group, pool))
    return made


def brute(groups, held, num_hit, max_length):
    step = groups[0].block_size
    best = num_hit
    for length in range(num_hit + step, max_length + 1, step):
        if all((b"%d" % i, m.group_id) in held
               for m in groups
               for i in range(max(num_hit // step, m.num_skipped_blocks(length)), length // step)):
            best = length
    return best


@pytest.mark.parametrize("kinds", ["f", "fs", "fm", "fsm", "m"])
@pytest.mark.parametrize("seed", range(15))
def test_the_hit_is_the_longest_length_every_group_can_be_filled_at(kinds, seed):
    rng = random.Random(seed)
    groups = managers(kinds)
    num_blocks = 12
    held = {(b"%d" % i, g) for i in range(num_blocks) for g in range(len(kinds)) if rng.random() < 0.8}
    num_hit = rng.randrange(0, 5) * 4
    max_length = rng.randrange(num_hit, num_blocks * 4 + 1)
    got = tier_hit(groups, held.__contains__, lambda size: [b"%d" % i for i in range(num_blocks)], num_hit, max_length)
    assert got == brute(groups, held, num_hit, max_length)


def test_a_sliding_window_needs_only_the_blocks_its_window_reaches():
    groups = managers("fs")
    # window 6, blocks of 4: at 32 tokens the window reaches blocks 6 and 7; at 28, 5 and 6
    held = {(b"%d" % i, 0) for i in range(8)} | {(b"%d" % i, 1) for i in (5, 6, 7)}
    assert tier_hit(groups, held.__contains__, lambda size: [b"%d" % i for i in range(8)], 0, 32) == 32
    held.discard((b"7", 1))
    assert tier_hit(groups, held.__contains__, lambda size: [b"%d" % i for i in range(8)], 0, 32) == 28
