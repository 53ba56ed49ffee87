"""allocate_kv_caches: views alias the buffers where the design says, describe() agrees."""

from __future__ import annotations

import pytest
import torch

from pd.kv_cache.allocation import (
    AttentionCache,
    KVCacheAllocation,
    MambaCache,
    allocate_kv_caches,
    torch_dtype,
)
from pd.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

NUM_BLOCKS = 6
LAYOUTS = ["canonical", "per-layer"]


def _config(groups: list[tuple[KVCacheSpec, list[str]]], num_blocks: int = NUM_BLOCKS) -> KVCacheConfig:
    kv_groups = tuple(KVCacheGroup(spec, tuple(names)) for spec, names in groups)
    return KVCacheConfig(num_blocks=num_blocks, groups=kv_groups)


def attention_only_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="float16")  # page 256
    return _config([(spec, ["a0", "a2"]), (spec, ["a1", "a3"])])


def _mamba_spec(page: int) -> MambaSpec:
    # bfloat16 conv, float32 SSM: B and C are 96 bytes, a head 128 of SSM + 24 of x conv.
    return MambaSpec(block_size=4, num_heads=2, head_dim=4, state_size=8, n_groups=2, conv_width=3,
                     conv_dtype="bfloat16", ssm_dtype="float32", page_size_padded=page)


def hybrid_config() -> KVCacheConfig:
    full = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="float32")  # page 512
    sliding = SlidingWindowSpec(block_size=4, num_kv_heads=2, head_size=16, dtype="bfloat16", sliding_window=8)
    mamba = _mamba_spec(page=512)  # real page 2 * 96 + 2 * 152 = 496, padded
    return _config([(full, ["f0", "f1", "f2"]), (sliding, ["s0", "s1"]), (mamba, ["m0", "m1", "m2"])])


CONFIGS = {"attention_only": attention_only_config, "hybrid": hybrid_config}


def _views(cache: AttentionCache | MambaCache) -> list[torch.Tensor]:
    return [cache.kv] if isinstance(cache, AttentionCache) else [cache.conv_bc, cache.conv_x, cache.ssm]


def _region(alloc: KVCacheAllocation, g: int, slot: int) -> tuple[int, int]:
    """(buffer index, layers in the region) of a layer: the design's oracle."""
    n = len(alloc.config.groups[g].layer_names)
    return (0, n) if alloc.layout == "canonical" else (slot, 1)


def _layers(config: KVCacheConfig) -> list[tuple[int, int, str]]:
    return [(g, slot, name) for g, group in enumerate(config.groups) for slot, name in enumerate(group.layer_names)]


def _in_ranges(addr: int, ranges: list[tuple[int, int]]) -> bool:
    return any(start <= addr < start + length for start, length in ranges)


def _changed(buffers: list[torch.Tensor], before: list[torch.Tensor]) -> dict[int, list[int]]:
    return {i: (buf != old).view(-1).nonzero().view(-1).tolist() for i, (buf, old) in enumerate(zip(buffers, before))}


def _scribble(view: torch.Tensor, gen: torch.Generator) -> None:
    """Change every byte `view` covers (all its elements, of any dtype)."""
    raw = torch.empty(view.shape, dtype=view.dtype)
    bytes_ = raw.view(torch.uint8) if raw.element_size() == 1 else raw.view(-1).view(torch.uint8)
    old = view.clone().contiguous().view(-1).view(torch.uint8)
    bytes_.view(-1).copy_(old + torch.randint(1, 256, old.shape, generator=gen, dtype=torch.uint8))
    view.copy_(raw)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", CONFIGS)
def test_a_blocks_views_tile_its_region_without_overlap(name: str, layout: str) -> None:
    """Every view of every layer of a group, for one block, covers bytes of the group's
    region in that block's row, no byte twice, and together exactly its data bytes."""
    config = CONFIGS[name]()
    alloc = allocate_kv_caches(config, layout=layout)
    described = alloc.describe()
    gen = torch.Generator().manual_seed(0)
    for g, group in enumerate(config.groups):
        for block in (1, NUM_BLOCKS - 1):
            ranges = described.block_ranges(g, [block])
            seen: dict[int, set[int]] = {}
            for slot, layer in enumerate(group.layer_names):
                buf_idx, _ = _region(alloc, g, slot)
                for view in _views(alloc.layer_caches[layer]):
                    before = [buf.clone() for buf in alloc.buffers]
                    _scribble(view[block], gen)
                    changed = _changed(alloc.buffers, before)
                    assert all(not c for i, c in changed.items() if i != buf_idx), f"{layer}: wrote elsewhere"
                    offsets = changed[buf_idx]
                    assert len(offsets) == view[block].numel() * view.element_size()
                    mine = seen.setdefault(buf_idx, set())
                    assert not mine & set(offsets), f"{layer}: bytes of another view"
                    mine.update(offsets)
                    base = alloc.buffers[buf_idx].data_ptr()
                    assert all(_in_ranges(base + o, ranges) for o in (offsets[0], offsets[-1]))
            row = alloc.buffers[0].shape[1]
            for offsets in seen.values():
                layers = 1 if layout == "per-layer" else len(group.layer_names)
                assert sorted(offsets) == list(range(block * row,
                                                     block * row + layers * group.spec.real_page_size_bytes))


def _head_slices(cache: AttentionCache | MambaCache, spec: KVCacheSpec, head: int) -> list[torch.Tensor]:
    """The parts of a layer's views that hold one head (attention) or, for Mamba, one head
    of its group."""
    if isinstance(cache, AttentionCache):
        return [cache.kv[:, :, :, head]]
    assert isinstance(spec, MambaSpec)
    per_group = spec.num_heads // spec.n_groups
    return [cache.conv_x[:, head // per_group, head % per_group], cache.ssm[:, head // per_group, head % per_group]]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", CONFIGS)
def test_each_piece_is_exactly_its_heads_bytes_in_every_layer(name: str, layout: str) -> None:
    """The design's claim: head h of every layer of a group (and a Mamba group's B and C)
    is the one range its piece names, relative to each ref of the group."""
    config = CONFIGS[name]()
    alloc = allocate_kv_caches(config, layout=layout)
    described = alloc.describe()
    gen = torch.Generator().manual_seed(1)
    block = 2
    for g, group in enumerate(config.groups):
        refs, pieces = described.group_data_refs[g], described.group_pieces[g]
        assert sum(p.nbytes for p in pieces) * len(refs) == len(group.layer_names) * group.spec.real_page_size_bytes
        for piece in pieces:
            kind, index = piece.key
            before = [buf.clone() for buf in alloc.buffers]
            for layer in group.layer_names:
                cache = alloc.layer_caches[layer]
                parts = (_head_slices(cache, group.spec, index) if kind == "head"
                         else [cache.conv_bc[:, index]])  # type: ignore[union-attr]
                for part in parts:
                    _scribble(part[block], gen)
            changed = _changed(alloc.buffers, before)
            expected: dict[int, list[int]] = {}
            for ref in refs:
                start = block * described.tensors[ref.tensor_idx].page_size_in_bytes + ref.offset_bytes + piece.offset
                expected[ref.tensor_idx] = list(range(start, start + piece.nbytes))
            assert {i: c for i, c in changed.items() if c} == expected, (g, piece.key)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_k_is_index_0_and_v_index_1(layout: str) -> None:
    config = hybrid_config()
    alloc = allocate_kv_caches(config, layout=layout)
    kv = alloc.layer_caches["s1"].kv  # sliding group, slot 1, bfloat16
    spec = config.groups[1].spec
    assert kv.dtype == torch.bfloat16
    kv[2, 1].fill_(3.5)  # V of every head of layer s1 in block 2
    buf_idx, layers = _region(alloc, 1, 1)
    start, head, half = 2 * alloc.buffers[buf_idx].shape[1], spec.head_page_bytes, spec.head_page_bytes // 2
    slot = 1 if alloc.layout == "canonical" else 0
    flat = alloc.buffers[buf_idx].view(-1)
    for h in range(spec.num_kv_heads):
        v = start + h * layers * head + slot * head + half  # heads outermost, then layers, then K/V
        assert torch.all(flat[v : v + half].view(torch.bfloat16) == 3.5)
        assert torch.all(flat[v - half : v] == 0)
    assert int(alloc.buffers[buf_idx].count_nonzero()) == half * spec.num_kv_heads


def test_shapes_and_dtypes() -> None:
    alloc = allocate_kv_caches(hybrid_config())
    assert alloc.layer_caches["f0"].kv.shape == (NUM_BLOCKS, 2, 4, 2, 8)
    assert alloc.layer_caches["f0"].kv.dtype == torch.float32
    assert alloc.layer_caches["s0"].kv.shape == (NUM_BLOCKS, 2, 4, 2, 16)
    m = alloc.layer_caches["m2"]
    assert (m.conv_x.shape, m.conv_x.dtype) == ((NUM_BLOCKS, 2, 1, 4, 3), torch.bfloat16)
    assert (m.conv_bc.shape, m.conv_bc.dtype) == ((NUM_BLOCKS, 2, 2, 8, 3), torch.bfloat16)
    assert (m.ssm.shape, m.ssm.dtype) == ((NUM_BLOCKS, 2, 1, 4, 8), torch.float32)
    assert [tuple(b.shape) for b in alloc.buffers] == [(NUM_BLOCKS, 3 * 512)]
    assert all(b.dtype == torch.int8 for b in alloc.buffers)
    per_layer = allocate_kv_caches(hybrid_config(), layout="per-layer")
    assert [tuple(b.shape) for b in per_layer.buffers] == [(NUM_BLOCKS, 512)] * 3


def test_canonical_group_block_is_one_range_and_runs_coalesce() -> None:
    config = hybrid_config()
    alloc = allocate_kv_caches(config)
    described = alloc.describe()
    assert len(described.tensors) == 1
    base, row, page = alloc.buffers[0].data_ptr(), config.cross_layer_page_bytes, config.page_size_bytes
    for g, group in enumerate(config.groups):
        n = len(group.layer_names)
        assert described.block_ranges(g, [3]) == [(base + 3 * row, n * page)]
        assert described.block_ranges(g, [1, 2, 3]) == [(base + row, 2 * row + n * page)]
        assert described.block_ranges(g, [1, 3]) == [(base + row, n * page), (base + 3 * row, n * page)]
    # The full group covers the whole row: a run is n * row contiguous bytes.
    assert described.block_ranges(0, [2, 3, 4]) == [(base + 2 * row, 3 * row)]


def test_per_layer_gives_one_range_per_layer() -> None:
    config = hybrid_config()
    alloc = allocate_kv_caches(config, layout="per-layer")
    described = alloc.describe()
    page = config.page_size_bytes
    assert len(described.tensors) == config.group_size
    for g, group in enumerate(config.groups):
        bases = [alloc.buffers[i].data_ptr() for i in range(len(group.layer_names))]
        assert described.block_ranges(g, [3]) == [(b + 3 * page, page) for b in bases]
        assert described.block_ranges(g, [2, 3]) == [(b + 2 * page, 2 * page) for b in bases]


def test_misaligned_rows_raise() -> None:
    # Page 498: the float32 SSM state of block 1 would start at a byte not a multiple of 4.
    mamba = _mamba_spec(page=498)
    with pytest.raises(ValueError, match="aligned"):
        allocate_kv_caches(_config([(mamba, ["m0"])]))
    with pytest.raises(ValueError, match="aligned"):  # row stride 498
        allocate_kv_caches(_config([(mamba, ["m0", "m1"])]), layout="per-layer")


def test_unknown_layout_raises() -> None:
    with pytest.raises(ValueError):
        allocate_kv_caches(attention_only_config(), layout="interleaved")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16", "float8_e4m3fn", "int8", "uint8"])
def test_torch_dtype(name: str) -> None:
    dtype = torch_dtype(name)
    assert isinstance(dtype, torch.dtype) and str(dtype) == f"torch.{name}"


def test_torch_dtype_unknown() -> None:
    with pytest.raises(ValueError):
        torch_dtype("complex64")


def test_zeroed_and_total_bytes() -> None:
    config = hybrid_config()
    for layout in LAYOUTS:
        alloc = allocate_kv_caches(config, layout=layout)
        total = sum(b.numel() for b in alloc.buffers)
        assert total == config.num_blocks * config.cross_layer_page_bytes
        assert all(int(b.count_nonzero()) == 0 for b in alloc.buffers)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_copy_blocks_copies_every_layer_of_a_block_and_nothing_else(layout: str) -> None:
    """What a forked sequence's block gets: the source block's data in every layer view
    (attention K/V, Mamba conv and SSM state); other blocks untouched."""
    allocation = allocate_kv_caches(hybrid_config(), "cpu", layout)
    gen = torch.Generator().manual_seed(0)
    for buffer in allocation.buffers:
        buffer.copy_(torch.randint(0, 64, buffer.shape, generator=gen, dtype=torch.int8))  # no NaN in any view
    before = [b.clone() for b in allocation.buffers]
    allocation.copy_blocks([(1, 4), (2, 5)])
    for name, cache in allocation.layer_caches.items():
        for view in _views(cache):
            assert torch.equal(view[4], view[1]) and torch.equal(view[5], view[2]), name
    for buffer, old in zip(allocation.buffers, before):
        assert torch.equal(buffer[:4], old[:4])
    allocation.copy_blocks([])  # nothing to copy: nothing changes
    assert all(torch.equal(b[4], b[1]) for b in allocation.buffers)
