"""The row order's claim, end to end on real allocations: a worker holding some heads
(a tensor-parallel rank) fills its blocks from workers holding others by copying the
byte runs `transfer_runs` plans, one run per block per pair of workers (two where a
Mamba group is split and B and C sit apart), and then its views read exactly the
heads a one-worker cache holds for it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pd.kv_cache.allocation import AttentionCache, KVCacheAllocation, MambaCache, allocate_kv_caches
from pd.kv_cache.canonical import CanonicalKVCaches
from pd.kv_cache.row_order import Piece, pieces, transfer_runs
from pd.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    round_up,
)

NUM_BLOCKS = 5
KV_HEADS, SLIDING_HEADS, MAMBA_HEADS, MAMBA_GROUPS = 4, 2, 8, 2
FULL = FullAttentionSpec(block_size=4, num_kv_heads=KV_HEADS, head_size=8, dtype="float32")
SLIDING = SlidingWindowSpec(block_size=4, num_kv_heads=SLIDING_HEADS, head_size=16, dtype="bfloat16", sliding_window=8)
MAMBA = MambaSpec(block_size=4, num_heads=MAMBA_HEADS, head_dim=4, state_size=8, n_groups=MAMBA_GROUPS,
                  conv_width=3, conv_dtype="bfloat16", ssm_dtype="float32")
LAYERS = {"full": ("f0", "f1", "f2"), "sliding": ("s0", "s1"), "mamba": ("m0", "m1", "m2")}


def _share(total: int, tp: int, rank: int) -> tuple[int, int]:
    """(first, count) of `total` heads on rank `rank` of `tp`: split when tp divides
    them, one replicated head (or group) otherwise."""
    if total % tp == 0:
        return rank * (total // tp), total // tp
    assert tp % total == 0
    return rank * total // tp, 1


def rank_cache(tp: int, rank: int, layout: str) -> tuple[KVCacheAllocation, CanonicalKVCaches]:
    """What rank `rank` of `tp` holds: its heads of every group, one page size."""
    full_first, full_n = _share(KV_HEADS, tp, rank)
    sliding_first, sliding_n = _share(SLIDING_HEADS, tp, rank)
    group_first, groups = _share(MAMBA_GROUPS, tp, rank)
    head_first, heads = rank * MAMBA_HEADS // tp, MAMBA_HEADS // tp
    specs: list[KVCacheSpec] = [replace(FULL, num_kv_heads=full_n), replace(SLIDING, num_kv_heads=sliding_n),
                                replace(MAMBA, num_heads=heads, n_groups=groups)]
    page = round_up(max(s.real_page_size_bytes for s in specs), 16)
    specs = [s if s.real_page_size_bytes == page else replace(s, page_size_padded=page) for s in specs]
    groups_ = tuple(KVCacheGroup(s, names) for s, names in zip(specs, LAYERS.values()))
    allocation = allocate_kv_caches(KVCacheConfig(num_blocks=NUM_BLOCKS, groups=groups_), layout=layout)
    first = [(full_first, 0), (sliding_first, 0), (head_first, group_first)]
    return allocation, allocation.describe(first)


def _fill(allocation: KVCacheAllocation, seed: int) -> None:
    # bytes below 64: no NaN or infinity in any float view, so views compare with equal
    gen = torch.Generator().manual_seed(seed)
    for buffer in allocation.buffers:
        buffer.copy_(torch.randint(0, 64, buffer.shape, generator=gen, dtype=torch.int8))


BLOCKS = ([1, 2], [3], [4])  # per group: a block is one group's at a time, its row that group's region


def _copy(source: tuple[KVCacheAllocation, CanonicalKVCaches], destination: tuple[KVCacheAllocation, CanonicalKVCaches],
          taken: list[set]) -> list[int]:
    """Fill destination's blocks (`BLOCKS`) from source's; the runs per block, per group."""
    (_, src), (_, dst) = source, destination
    counts = []
    for g, (src_refs, dst_refs) in enumerate(zip(src.group_data_refs, dst.group_data_refs)):
        runs = transfer_runs(src.group_pieces[g], dst.group_pieces[g], taken[g])
        counts.append(len(runs))
        for src_ref, dst_ref in zip(src_refs, dst_refs):
            s_buf, d_buf = src.tensors[src_ref.tensor_idx].tensor, dst.tensors[dst_ref.tensor_idx].tensor
            for block in BLOCKS[g]:
                for s_off, d_off, n in runs:
                    s0, d0 = src_ref.offset_bytes + s_off, dst_ref.offset_bytes + d_off
                    d_buf[block, d0 : d0 + n] = s_buf[block, s0 : s0 + n]
    return counts


def _expected(whole: KVCacheAllocation, tp: int, rank: int, layer: str) -> list[torch.Tensor]:
    """The one-worker cache's views cut to what rank `rank` of `tp` holds."""
    cache = whole.layer_caches[layer]
    if isinstance(cache, AttentionCache):
        first, n = _share(KV_HEADS if layer.startswith("f") else SLIDING_HEADS, tp, rank)
        return [cache.kv[:, :, :, first : first + n]]
    assert isinstance(cache, MambaCache)
    per_group = MAMBA_HEADS // MAMBA_GROUPS
    head_first, heads = rank * MAMBA_HEADS // tp, MAMBA_HEADS // tp
    group_first, groups = _share(MAMBA_GROUPS, tp, rank)
    g = slice(group_first, group_first + groups)
    if groups * per_group == heads:  # whole groups
        return [cache.conv_bc[:, g], cache.conv_x[:, g], cache.ssm[:, g]]
    j = slice(head_first % per_group, head_first % per_group + heads)
    return [cache.conv_bc[:, g], cache.conv_x[:, g, j], cache.ssm[:, g, j]]


def _views(cache: AttentionCache | MambaCache) -> list[torch.Tensor]:
    return [cache.kv] if isinstance(cache, AttentionCache) else [cache.conv_bc, cache.conv_x, cache.ssm]


PAIRS = [(1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 4), (4, 2)]


@pytest.mark.parametrize("layout", ["canonical", "per-layer"])
@pytest.mark.parametrize("p_tp, d_tp", PAIRS)
def test_decode_ranks_read_exactly_their_heads_from_prefill_ranks(p_tp: int, d_tp: int, layout: str) -> None:
    whole, _ = rank_cache(1, 0, layout)
    _fill(whole, seed=0)
    prefill = []
    for rank in range(p_tp):  # prefill rank r holds its share of the one-worker cache's bytes
        source = rank_cache(p_tp, rank, layout)
        _copy((whole, whole.describe()), source, [set(), set(), set()])
        prefill.append(source)
    for rank in range(d_tp):
        decode = rank_cache(d_tp, rank, layout)
        _fill(decode[0], seed=100 + rank)  # stale bytes everywhere: the read must replace them
        taken: list[set] = [set(), set(), set()]
        runs = [_copy(source, decode, taken) for source in prefill]
        for blocks, names in zip(BLOCKS, LAYERS.values()):
            for layer in names:
                for got, want in zip(_views(decode[0].layer_caches[layer]), _expected(whole, d_tp, rank, layer)):
                    assert torch.equal(got[blocks], want[blocks]), (layer, rank)
        # every piece came from one prefill rank, and at most the runs the design says
        assert all(len(t) == len(p) for t, p in zip(taken, decode[1].group_pieces))
        for g in range(3):
            assert sum(r[g] for r in runs) <= max(1, p_tp // d_tp) + (g == 2), (g, runs)


def test_attention_runs_per_pair_never_exceed_one() -> None:
    """Same heads or a contiguous share of them: one run per region, any TP pair."""
    for p_tp, d_tp in PAIRS:
        for d_rank in range(d_tp):
            _, dst = rank_cache(d_tp, d_rank, "canonical")
            for p_rank in range(p_tp):
                _, src = rank_cache(p_tp, p_rank, "canonical")
                for g in (0, 1):
                    assert len(transfer_runs(src.group_pieces[g], dst.group_pieces[g], set())) <= 1


def test_a_mamba_group_split_in_two_costs_one_more_run_for_its_second_half() -> None:
    """[B, C | heads] per group: the first half of a group's heads is one run with B and
    C, the second half two (TP 4 over 2 Mamba groups)."""
    _, whole = rank_cache(1, 0, "canonical")
    counts = [len(transfer_runs(whole.group_pieces[2], rank_cache(4, r, "canonical")[1].group_pieces[2], set()))
              for r in range(4)]
    assert counts == [1, 2, 1, 2]


def test_transfer_runs_refuses_pieces_of_different_sizes() -> None:
    a = (Piece(("head", 0), 0, 8),)
    b = (Piece(("head", 0), 0, 16),)
    with pytest.raises(ValueError, match="bytes"):
        transfer_runs(a, b, set())


def test_pieces_of_a_region_cover_it_in_byte_order() -> None:
    for spec in (FULL, SLIDING, MAMBA):
        for layers in (1, 3):
            parts = pieces(spec, layers)
            assert [p.offset for p in parts] == sorted(p.offset for p in parts)
            assert all(a.offset + a.nbytes == b.offset for a, b in zip(parts, parts[1:]))
            assert parts[-1].offset + parts[-1].nbytes == layers * spec.real_page_size_bytes
