"""CanonicalKVCaches: validation and the byte ranges a connector moves."""

from __future__ import annotations

import pytest
import torch

from pd.kv_cache.canonical import CanonicalKVCaches, KVCacheBlockDataRef, KVCacheBlockTensor

NUM_BLOCKS = 8
ROW = 64


def _caches(refs: list[KVCacheBlockDataRef], num_tensors: int = 1) -> CanonicalKVCaches:
    tensors = [KVCacheBlockTensor(torch.zeros(NUM_BLOCKS, ROW, dtype=torch.int8)) for _ in range(num_tensors)]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=[refs])


def test_block_tensor_properties() -> None:
    t = torch.zeros(5, 48, dtype=torch.int8)
    bt = KVCacheBlockTensor(t)
    assert (bt.num_blocks, bt.page_size_in_bytes) == (5, 48)
    assert bt.base_address == t.data_ptr()
    assert bt.device == torch.device("cpu")


@pytest.mark.parametrize(
    "tensor",
    [
        torch.zeros(4, 16, dtype=torch.float32),  # not int8
        torch.zeros(4, 16, dtype=torch.uint8),  # not int8
        torch.zeros(64, dtype=torch.int8),  # 1-D
        torch.zeros(4, 4, 4, dtype=torch.int8),  # 3-D
        torch.zeros(4, 32, dtype=torch.int8)[:, ::2],  # row not contiguous
        torch.zeros(4, 32, dtype=torch.int8)[:, :16],  # row stride != row length
        torch.zeros(16, 4, dtype=torch.int8).t(),  # column-major
    ],
)
def test_block_tensor_rejects_bad_tensors(tensor: torch.Tensor) -> None:
    with pytest.raises(ValueError):
        KVCacheBlockTensor(tensor)


def test_rejects_mismatched_block_counts() -> None:
    a = KVCacheBlockTensor(torch.zeros(4, ROW, dtype=torch.int8))
    b = KVCacheBlockTensor(torch.zeros(5, ROW, dtype=torch.int8))
    with pytest.raises(ValueError):
        CanonicalKVCaches(tensors=[a, b], group_data_refs=[[KVCacheBlockDataRef(0, ROW)]])


@pytest.mark.parametrize(
    "ref",
    [KVCacheBlockDataRef(1, ROW), KVCacheBlockDataRef(0, ROW, offset_bytes=1), KVCacheBlockDataRef(0, ROW + 1)],
)
def test_rejects_refs_outside_the_tensors(ref: KVCacheBlockDataRef) -> None:
    with pytest.raises(ValueError):
        _caches([ref])


def test_num_blocks() -> None:
    assert _caches([KVCacheBlockDataRef(0, ROW)]).num_blocks == NUM_BLOCKS


def test_whole_row_ref_coalesces_consecutive_ids() -> None:
    caches = _caches([KVCacheBlockDataRef(0, ROW)])
    base = caches.tensors[0].base_address
    assert caches.block_ranges(0, [3]) == [(base + 3 * ROW, ROW)]
    assert caches.block_ranges(0, [2, 3, 4]) == [(base + 2 * ROW, 3 * ROW)]
    assert caches.block_ranges(0, [2, 3, 5, 6, 1]) == [
        (base + 2 * ROW, 2 * ROW),
        (base + 5 * ROW, 2 * ROW),
        (base + 1 * ROW, ROW),
    ]


def test_order_kept_and_nothing_deduplicated() -> None:
    caches = _caches([KVCacheBlockDataRef(0, ROW)])
    base = caches.tensors[0].base_address
    assert caches.block_ranges(0, [5, 4]) == [(base + 5 * ROW, ROW), (base + 4 * ROW, ROW)]
    assert caches.block_ranges(0, [3, 3]) == [(base + 3 * ROW, ROW), (base + 3 * ROW, ROW)]
    assert caches.block_ranges(0, []) == []


def test_partial_ref_run_spans_rows_between() -> None:
    caches = _caches([KVCacheBlockDataRef(0, 32, offset_bytes=16)])
    base = caches.tensors[0].base_address
    # Block 2's bytes [16, 48) through block 3's bytes [16, 48): one range of ROW + 32.
    assert caches.block_ranges(0, [2, 3]) == [(base + 2 * ROW + 16, ROW + 32)]


def test_one_range_per_ref_per_run() -> None:
    refs = [KVCacheBlockDataRef(i, ROW) for i in range(3)]
    caches = _caches(refs, num_tensors=3)
    bases = [t.base_address for t in caches.tensors]
    ranges = caches.block_ranges(0, [1, 2, 6])
    assert ranges == [r for b in bases for r in [(b + ROW, 2 * ROW), (b + 6 * ROW, ROW)]]


def test_ranges_cover_exactly_the_referenced_bytes() -> None:
    """Marking every byte a range names must mark the ref's bytes of those rows, no more."""
    offset, size = 8, 40
    caches = _caches([KVCacheBlockDataRef(0, size, offset_bytes=offset)])
    tensor = caches.tensors[0].tensor
    block_ids = [1, 2, 3, 6]
    flat = tensor.view(-1)
    for addr, length in caches.block_ranges(0, block_ids):
        start = addr - caches.tensors[0].base_address
        flat[start : start + length] += 1
    expected = torch.zeros_like(tensor)
    expected[block_ids, offset : offset + size] = 1
    # Bytes between the ref's slices of a run (rows 1-3) are inside the ranges too.
    expected[1:3, offset + size :] = 1
    expected[2:4, :offset] = 1
    assert torch.equal(tensor, expected)


def test_out_of_range_block_id() -> None:
    caches = _caches([KVCacheBlockDataRef(0, ROW)])
    with pytest.raises(IndexError):
        caches.block_ranges(0, [NUM_BLOCKS])
