"""The coordinators' cache-hit search against a brute-force oracle.

The oracle tries every length, longest first, and applies each spec's hit rule directly
(full attention: every block before L; sliding window W: the blocks covering
[L-W+1, L); Mamba: the block ending at L). The coordinator must find the same length and
the same blocks, with nulls exactly where a block is not needed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from kv_events.hashing import extend_block_hashes
from pd.kv_cache.block_pool import KVCacheBlock
from pd.kv_cache.coordinator import (
    HybridKVCacheCoordinator,
    NoPrefixCacheCoordinator,
    UnitaryKVCacheCoordinator,
)
from pd.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

PAGE = 1 << 16


def full(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=4, dtype="float32", page_size_padded=PAGE
    )


def sliding(block_size: int, window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=4,
        dtype="float32",
        sliding_window=window,
        page_size_padded=PAGE,
    )


def mamba(block_size: int) -> MambaSpec:
    return MambaSpec(
        block_size=block_size,
        num_heads=1, head_dim=2, state_size=2, n_groups=1, conv_width=3,
        conv_dtype="float32",
        ssm_dtype="float32",
        page_size_padded=PAGE,
    )


def config_of(specs: list[KVCacheSpec], num_blocks: int) -> KVCacheConfig:
    groups = tuple(KVCacheGroup(s, (f"layer{i}",)) for i, s in enumerate(specs))
    return KVCacheConfig(num_blocks=num_blocks, groups=groups)


def oracle_valid(spec: KVCacheSpec, cached: set[int], num_tokens: int) -> bool:
    """Whether a hit of `num_tokens` tokens is usable for a group with `cached` blocks."""
    n = num_tokens // spec.block_size
    if isinstance(spec, MambaSpec):
        return n == 0 or (n - 1) in cached
    if isinstance(spec, SlidingWindowSpec):
        first = max(0, num_tokens - spec.sliding_window + 1) // spec.block_size
        return all(i in cached for i in range(first, n))
    return all(i in cached for i in range(n))


def oracle_needed(spec: KVCacheSpec, num_tokens: int) -> set[int]:
    """Block indices a hit of `num_tokens` tokens must hold real blocks at."""
    n = num_tokens // spec.block_size
    if isinstance(spec, MambaSpec):
        return {n - 1} if n else set()
    if isinstance(spec, SlidingWindowSpec):
        first = max(0, num_tokens - spec.sliding_window + 1) // spec.block_size
        return set(range(first, n))
    return set(range(n))


@dataclass
class Scenario:
    specs: list[KVCacheSpec]
    cached: list[set[int]]  # per group: cached block indices of the request's hash chain
    tokens: list[int]
    max_length: int
    skip: frozenset[int]


def build(scenario: Scenario, coordinator_class=HybridKVCacheCoordinator):
    """A coordinator whose pool caches, per group, exactly `scenario.cached` blocks of the
    request's chain (freed, so they sit evictable in the free queue, and some held)."""
    num_cached = sum(len(c) for c in scenario.cached)
    config = config_of(scenario.specs, num_blocks=num_cached + 2)
    coordinator = coordinator_class(config)
    pool = coordinator.pool
    hashes = {}
    for group_id, (spec, cached) in enumerate(zip(scenario.specs, scenario.cached)):
        chain = hashes.setdefault(
            spec.block_size, extend_block_hashes([], scenario.tokens, spec.block_size)
        )
        for i in sorted(cached):
            (block,) = pool.get_new_blocks(1)
            positional: list[KVCacheBlock] = [pool.null_block] * i + [block]
            pool.cache_full_blocks(chain, positional, i, i + 1, group_id)
            pool.free_blocks([block])
    return coordinator, lambda block_size: hashes[block_size]


def oracle_hit(scenario: Scenario) -> int:
    lcm = math.lcm(*(s.block_size for s in scenario.specs))
    constraining = [i for i in range(len(scenario.specs)) if i not in scenario.skip]
    if not constraining:
        return 0
    for num_tokens in range(scenario.max_length // lcm * lcm, -1, -lcm):
        if all(
            oracle_valid(scenario.specs[g], scenario.cached[g], num_tokens) for g in constraining
        ):
            return num_tokens
    raise AssertionError("0 is always a valid hit")


def check_against_oracle(scenario: Scenario, coordinator_class=HybridKVCacheCoordinator) -> int:
    coordinator, hashes = build(scenario, coordinator_class)
    pool = coordinator.pool
    hit = coordinator.find_longest_cache_hit(hashes, scenario.max_length, scenario.skip)
    expected = oracle_hit(scenario)
    assert hit.num_tokens == expected, f"hit {hit.num_tokens} != oracle {expected}"
    for group_id, spec in enumerate(scenario.specs):
        blocks = hit.blocks[group_id]
        assert len(blocks) == (0 if group_id in scenario.skip else expected // spec.block_size)
        needed = set() if group_id in scenario.skip else oracle_needed(spec, expected)
        chain = hashes(spec.block_size)
        for i, block in enumerate(blocks):
            if i in needed:
                cached = pool.get_cached_block(chain[i], [group_id])
                assert cached is not None and block is cached[0], (group_id, i)
            else:
                assert block is pool.null_block, (group_id, i, block)
    pool.check_integrity()
    return expected


BLOCK_SIZES = st.sampled_from([16, 32])
WINDOWS = st.sampled_from([1, 2, 16, 17, 31, 33, 48, 64, 100])


@st.composite
def spec_strategy(draw) -> KVCacheSpec:
    kind = draw(st.sampled_from(["full", "sliding", "mamba"]))
    block_size = draw(BLOCK_SIZES)
    if kind == "full":
        return full(block_size)
    if kind == "sliding":
        return sliding(block_size, draw(WINDOWS))
    return mamba(block_size)


@st.composite
def scenarios(draw, min_groups: int = 2, max_groups: int = 4) -> Scenario:
    # A few distinct specs, then groups drawn from them: several groups of one type, in
    # any (interleaved) order, with or without full attention.
    distinct = draw(st.lists(spec_strategy(), min_size=1, max_size=3))
    num_groups = draw(st.integers(min_groups, max_groups))
    specs = [draw(st.sampled_from(distinct)) for _ in range(num_groups)]
    num_tokens = draw(st.integers(1, 12 * 32))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    density = draw(st.sampled_from([0.3, 0.7, 0.9, 1.0]))
    cached = [
        {i for i in range(num_tokens // s.block_size) if rng.random() < density} for s in specs
    ]
    max_length = draw(st.integers(0, num_tokens))
    mamba_ids = [i for i, s in enumerate(specs) if isinstance(s, MambaSpec)]
    skip = frozenset(mamba_ids) if draw(st.booleans()) else frozenset()
    tokens = [rng.randrange(1000) for _ in range(num_tokens)]
    return Scenario(specs, cached, tokens, max_length, skip)


@settings(max_examples=600, deadline=None)
@given(scenarios())
def test_hybrid_hit_matches_oracle(scenario: Scenario) -> None:
    check_against_oracle(scenario)


@settings(max_examples=200, deadline=None)
@given(scenarios(min_groups=1, max_groups=1))
def test_unitary_hit_matches_oracle(scenario: Scenario) -> None:
    check_against_oracle(scenario, UnitaryKVCacheCoordinator)
    check_against_oracle(scenario, HybridKVCacheCoordinator)


def test_no_prefix_cache_always_misses() -> None:
    scenario = Scenario([full(16), mamba(16)], [{0, 1, 2}, {0, 1, 2}], list(range(64)), 63, frozenset())
    coordinator, hashes = build(scenario, lambda cfg: NoPrefixCacheCoordinator(cfg))
    hit = coordinator.find_longest_cache_hit(hashes, 63, frozenset())
    assert hit.num_tokens == 0 and all(b == [] for b in hit.blocks)


def test_mamba_miss_collapses_hit_unless_skipped() -> None:
    # Attention holds the whole prefix, Mamba holds nothing: without the skip the hit is
    # 0; skipping Mamba keeps attention's 48 tokens and gives Mamba no hit blocks.
    specs = [full(16), mamba(16), full(16)]
    cached = [{0, 1, 2}, set(), {0, 1, 2}]
    tokens = list(range(64))
    assert check_against_oracle(Scenario(specs, cached, tokens, 63, frozenset())) == 0
    coordinator, hashes = build(Scenario(specs, cached, tokens, 63, frozenset({1})))
    hit = coordinator.find_longest_cache_hit(hashes, 63, frozenset({1}))
    assert hit.num_tokens == 48
    assert hit.blocks[1] == []
    assert hit.group_hit_tokens == (48, None, 48)


def test_fixed_point_needs_several_rounds() -> None:
    # Full attention allows 8 blocks (128 tokens). Round 1: Mamba (states after blocks
    # 1, 3, 7) says 128, the window (33 tokens: the 2 blocks before the hit point) says 80.
    # Round 2: Mamba says 64, the window 32. Round 3: both accept 32.
    specs = [mamba(16), sliding(16, 33), full(16)]
    cached = [{1, 3, 7}, {0, 1, 3, 4}, set(range(8))]
    scenario = Scenario(specs, cached, list(range(8 * 16 + 1)), 8 * 16, frozenset())
    assert check_against_oracle(scenario) == 32


def test_lcm_alignment_with_mixed_block_sizes() -> None:
    # Block sizes 16 and 32 -> hits are multiples of 32 even when the 16-token group
    # could stop at 48.
    specs = [full(16), full(32)]
    cached = [{0, 1, 2}, {0, 1, 2}]
    scenario = Scenario(specs, cached, list(range(128)), 127, frozenset())
    assert check_against_oracle(scenario) == 32


def test_group_hits_report_each_type_alone() -> None:
    specs = [full(16), mamba(16)]
    cached = [{0, 1, 2, 3}, {1}]
    coordinator, hashes = build(Scenario(specs, cached, list(range(80)), 79, frozenset()))
    hit = coordinator.find_longest_cache_hit(hashes, 79, frozenset())
    assert hit.num_tokens == 32
    assert hit.group_hit_tokens == (64, 32)


def test_unitary_rejects_several_groups() -> None:
    try:
        UnitaryKVCacheCoordinator(config_of([full(16), full(16)], 4))
    except ValueError as e:
        assert "exactly one" in str(e)
    else:
        raise AssertionError("a two-group config was accepted")

