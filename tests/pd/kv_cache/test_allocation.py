"""allocate_kv_caches: views alias the buffers where the design says, describe() agrees."""

from __future__ import annotations

import pytest
import torch

from pd.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from pd.kv_cache.allocation import (
    AttentionCache,
    KVCacheAllocation,
    MambaCache,
    allocate_kv_caches,
    torch_dtype,
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
    # conv: 15 bfloat16 = 30 bytes, so the float32 SSM state starts at 32, not 30.
    return MambaSpec(
        block_size=4,
        conv_state_shape=(3, 5),
        ssm_state_shape=(2, 4, 8),
        conv_dtype="bfloat16",
        ssm_dtype="float32",
        page_size_padded=page,
    )


def hybrid_config() -> KVCacheConfig:
    full = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="float32")  # page 512
    sliding = SlidingWindowSpec(block_size=4, num_kv_heads=2, head_size=16, dtype="bfloat16", sliding_window=8)
    mamba = _mamba_spec(page=512)  # real page 288, padded
    return _config([(full, ["f0", "f1", "f2"]), (sliding, ["s0", "s1"]), (mamba, ["m0", "m1", "m2"])])


CONFIGS = {"attention_only": attention_only_config, "hybrid": hybrid_config}


def _regions(cache: AttentionCache | MambaCache, spec: KVCacheSpec) -> list[tuple[torch.Tensor, int, int]]:
    """(view, byte offset in the layer's page, bytes per block) of each tensor of a layer."""
    if isinstance(cache, AttentionCache):
        return [(cache.kv, 0, spec.real_page_size_bytes)]
    assert isinstance(spec, MambaSpec)
    return [(cache.conv, 0, spec.conv_state_bytes), (cache.ssm, spec.ssm_offset_bytes, spec.ssm_state_bytes)]


def _page_start(alloc: KVCacheAllocation, slot: int, block: int) -> tuple[int, int]:
    """Oracle from the design: (buffer index, byte offset in it) of layer slot `slot`, block `block`."""
    page = alloc.config.page_size_bytes
    if alloc.layout == "canonical":
        return 0, block * alloc.config.cross_layer_page_bytes + slot * page
    return slot, block * page


def _layers(config: KVCacheConfig) -> list[tuple[int, int, str]]:
    return [(g, slot, name) for g, group in enumerate(config.groups) for slot, name in enumerate(group.layer_names)]


def _in_ranges(addr: int, ranges: list[tuple[int, int]]) -> bool:
    return any(start <= addr < start + length for start, length in ranges)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", CONFIGS)
def test_write_through_view_changes_exactly_the_described_bytes(name: str, layout: str) -> None:
    config = CONFIGS[name]()
    alloc = allocate_kv_caches(config, layout=layout)
    described = alloc.describe()
    gen = torch.Generator().manual_seed(0)
    for g, slot, layer in _layers(config):
        spec = config.groups[g].spec
        for block in (1, NUM_BLOCKS - 1):
            ranges = described.block_ranges(g, [block])
            for view, offset, nbytes in _regions(alloc.layer_caches[layer], spec):
                before = [buf.clone() for buf in alloc.buffers]
                # Layer i of every group shares slot i: differ from what is there already.
                block_bytes = view[block].view(torch.uint8).view(-1)
                pattern = block_bytes + torch.randint(1, 256, (nbytes,), generator=gen, dtype=torch.uint8)
                block_bytes.copy_(pattern)
                buf_idx, start = _page_start(alloc, slot, block)
                start += offset
                for i, buf in enumerate(alloc.buffers):
                    changed = (buf != before[i]).view(-1).nonzero().view(-1)
                    if i != buf_idx:
                        assert changed.numel() == 0, f"{layer}: wrote into buffer {i}"
                        continue
                    assert changed.tolist() == list(range(start, start + nbytes)), layer
                    raw = buf.view(-1)[start : start + nbytes].view(torch.uint8)
                    assert torch.equal(raw, pattern)
                    base = buf.data_ptr()
                    assert _in_ranges(base + start, ranges) and _in_ranges(base + start + nbytes - 1, ranges)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_k_is_index_0_and_v_index_1(layout: str) -> None:
    config = hybrid_config()
    alloc = allocate_kv_caches(config, layout=layout)
    kv = alloc.layer_caches["s1"].kv  # sliding group, slot 1, bfloat16
    spec = config.groups[1].spec
    assert kv.dtype == torch.bfloat16
    kv[2, 1].fill_(3.5)
    buf_idx, start = _page_start(alloc, 1, 2)
    half = spec.real_page_size_bytes // 2
    flat = alloc.buffers[buf_idx].view(-1)
    assert torch.all(flat[start + half : start + 2 * half].view(torch.bfloat16) == 3.5)
    assert torch.all(flat[start : start + half] == 0)
    assert int(alloc.buffers[buf_idx].count_nonzero()) == half


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", CONFIGS)
def test_views_alias_buffers_with_block_dim_leading(name: str, layout: str) -> None:
    config = CONFIGS[name]()
    alloc = allocate_kv_caches(config, layout=layout)
    for g, slot, layer in _layers(config):
        for view, offset, nbytes in _regions(alloc.layer_caches[layer], config.groups[g].spec):
            assert view.shape[0] == config.num_blocks
            assert view[0].numel() * view.element_size() == nbytes
            for block in range(config.num_blocks):
                buf_idx, start = _page_start(alloc, slot, block)
                buf = alloc.buffers[buf_idx]
                row = buf.shape[1]
                row_start = buf.data_ptr() + block * row
                assert view[block].is_contiguous()
                assert view[block].data_ptr() == buf.data_ptr() + start + offset
                assert row_start <= view[block].data_ptr()
                assert view[block].data_ptr() + nbytes <= row_start + row


def test_shapes_and_dtypes() -> None:
    alloc = allocate_kv_caches(hybrid_config())
    assert alloc.layer_caches["f0"].kv.shape == (NUM_BLOCKS, 2, 4, 2, 8)
    assert alloc.layer_caches["f0"].kv.dtype == torch.float32
    assert alloc.layer_caches["s0"].kv.shape == (NUM_BLOCKS, 2, 4, 2, 16)
    m = alloc.layer_caches["m2"]
    assert (m.conv.shape, m.conv.dtype) == ((NUM_BLOCKS, 3, 5), torch.bfloat16)
    assert (m.ssm.shape, m.ssm.dtype) == ((NUM_BLOCKS, 2, 4, 8), torch.float32)
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


def test_misaligned_ssm_offset_raises() -> None:
    # Page 290: slot 1's SSM state (float32) would start at byte 290 + 32, not a multiple of 4.
    mamba = _mamba_spec(page=290)
    config = _config([(mamba, ["m0", "m1"])])
    with pytest.raises(ValueError, match="aligned"):
        allocate_kv_caches(config)
    with pytest.raises(ValueError, match="aligned"):  # row stride 290
        allocate_kv_caches(config, layout="per-layer")


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
        for view in ([cache.kv] if isinstance(cache, AttentionCache) else [cache.conv, cache.ssm]):
            assert torch.equal(view[4], view[1]) and torch.equal(view[5], view[2]), name
    for buffer, old in zip(allocation.buffers, before):
        assert torch.equal(buffer[:4], old[:4])
    allocation.copy_blocks([])  # nothing to copy: nothing changes
    assert all(torch.equal(b[4], b[1]) for b in allocation.buffers)
