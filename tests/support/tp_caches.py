"""KV caches of tensor-parallel ranks of one small hybrid model (full attention, sliding
window, Mamba2): what rank r of TP = t holds, and the one-rank cache's views cut to it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from pd.kv_cache.allocation import AttentionCache, KVCacheAllocation, MambaCache, allocate_kv_caches
from pd.kv_cache.canonical import CanonicalKVCaches
from pd.kv_cache.row_order import transfer_runs
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


def share(total: int, tp: int, rank: int) -> tuple[int, int]:
    """(first, count) of `total` heads on rank `rank` of `tp`: split when tp divides
    them, one replicated head (or group) otherwise."""
    if total % tp == 0:
        return rank * (total // tp), total // tp
    assert tp % total == 0
    return rank * total // tp, 1


def rank_cache(tp: int, rank: int, layout: str,
               num_blocks: int = NUM_BLOCKS) -> tuple[KVCacheAllocation, CanonicalKVCaches]:
    """What rank `rank` of `tp` holds: its heads of every group, one page size."""
    full_first, full_n = share(KV_HEADS, tp, rank)
    sliding_first, sliding_n = share(SLIDING_HEADS, tp, rank)
    group_first, groups = share(MAMBA_GROUPS, tp, rank)
    head_first, heads = rank * MAMBA_HEADS // tp, MAMBA_HEADS // tp
    specs: list[KVCacheSpec] = [replace(FULL, num_kv_heads=full_n), replace(SLIDING, num_kv_heads=sliding_n),
                                replace(MAMBA, num_heads=heads, n_groups=groups)]
    page = round_up(max(s.real_page_size_bytes for s in specs), 16)
    specs = [s if s.real_page_size_bytes == page else replace(s, page_size_padded=page) for s in specs]
    groups_ = tuple(KVCacheGroup(s, names) for s, names in zip(specs, LAYERS.values()))
    allocation = allocate_kv_caches(KVCacheConfig(num_blocks=num_blocks, groups=groups_), layout=layout)
    first = [(full_first, 0), (sliding_first, 0), (head_first, group_first)]
    return allocation, allocation.describe(first)


def fill(allocation: KVCacheAllocation, seed: int) -> None:
    # bytes below 64: no NaN or infinity in any float view, so views compare with equal
    gen = torch.Generator().manual_seed(seed)
    for buffer in allocation.buffers:
        buffer.copy_(torch.randint(0, 64, buffer.shape, generator=gen, dtype=torch.int8))


def expected_views(whole: KVCacheAllocation, tp: int, rank: int, layer: str) -> list[torch.Tensor]:
    """The one-worker cache's views cut to what rank `rank` of `tp` holds."""
    cache = whole.layer_caches[layer]
    if isinstance(cache, AttentionCache):
        first, n = share(KV_HEADS if layer.startswith("f") else SLIDING_HEADS, tp, rank)
        return [cache.kv[:, :, :, first : first + n]]
    assert isinstance(cache, MambaCache)
    per_group = MAMBA_HEADS // MAMBA_GROUPS
    head_first, heads = rank * MAMBA_HEADS // tp, MAMBA_HEADS // tp
    group_first, groups = share(MAMBA_GROUPS, tp, rank)
    g = slice(group_first, group_first + groups)
    if groups * per_group == heads:  # whole groups
        return [cache.conv_bc[:, g], cache.conv_x[:, g], cache.ssm[:, g]]
    j = slice(head_first % per_group, head_first % per_group + heads)
    return [cache.conv_bc[:, g], cache.conv_x[:, g, j], cache.ssm[:, g, j]]


def views(cache: AttentionCache | MambaCache) -> list[torch.Tensor]:
    return [cache.kv] if isinstance(cache, AttentionCache) else [cache.conv_bc, cache.conv_x, cache.ssm]


RankCache = tuple[KVCacheAllocation, CanonicalKVCaches]


def copy_pieces(source: RankCache, destination: RankCache, taken: list[set], blocks: Sequence[Sequence[int]]
                ) -> list[int]:
    """Fill destination's `blocks[g]` of each group g from source's same blocks, piece by
    piece as `transfer_runs` plans; the runs per block, per group."""
    (_, src), (_, dst) = source, destination
    counts = []
    for g, (src_refs, dst_refs) in enumerate(zip(src.group_data_refs, dst.group_data_refs)):
        runs = transfer_runs(src.group_pieces[g], dst.group_pieces[g], taken[g])
        counts.append(len(runs))
        for src_ref, dst_ref in zip(src_refs, dst_refs):
            s_buf, d_buf = src.tensors[src_ref.tensor_idx].tensor, dst.tensors[dst_ref.tensor_idx].tensor
            for block in blocks[g]:
                for s_off, d_off, n in runs:
                    s0, d0 = src_ref.offset_bytes + s_off, dst_ref.offset_bytes + d_off
                    d_buf[block, d0 : d0 + n] = s_buf[block, s0 : s0 + n]
    return counts
