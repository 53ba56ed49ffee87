"""KV block digests: one per (group, position, unit), found again by position; a byte
changed anywhere in a unit read is a mismatch naming where; units not read, blocks not
read and null positions are not checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pd.kv_cache.allocation import allocate_kv_caches
from pd.kv_cache.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup
from pd.kv_transfer.digests import DIGEST_BYTES, BlockDigests, expected, mismatch

SPEC = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
CONFIG = KVCacheConfig(num_blocks=16, groups=(KVCacheGroup(SPEC, ("a", "b")), KVCacheGroup(SPEC, ("c",))))


@pytest.fixture(params=["canonical", "per-layer"])
def caches(request):
    alloc = allocate_kv_caches(CONFIG, "cpu", request.param)
    for buf in alloc.buffers:
        buf.copy_(torch.randint(-128, 127, buf.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(0)))
    return alloc


def test_a_requests_digests_are_per_position_and_unit(caches) -> None:
    digests = BlockDigests(caches.describe())
    units = [len(digests.units[g]) for g in range(2)]
    assert units == [2, 2]  # two KV heads each
    ids = [[3, 0, 5], [0, 7, 0]]
    blob = digests.request(ids)
    assert len(blob) == DIGEST_BYTES * (3 + 3) * 2
    tables = expected(blob, ids, units)
    assert tables[0][1].tolist() == [0, 0] and tables[1][0].tolist() == [0, 0]  # null positions
    assert int(tables[0][2, 1]) == digests.digest(0, 5, 1) and int(tables[1][1, 0]) == digests.digest(1, 7, 0)
    assert len({int(x) for t in tables for x in t.ravel() if x}) == 6  # distinct bytes, distinct digests
    with pytest.raises(ValueError, match="need"):
        expected(blob[:-8], ids, units)


def test_a_byte_changed_in_a_unit_read_is_a_mismatch_naming_it(caches) -> None:
    cache = caches.describe()
    digests = BlockDigests(cache)
    remote = [[3, 0, 5], [0, 7, 0]]
    blob = digests.request(remote)
    keys = [digests.unit_keys(g) for g in range(2)]
    every = [set(k) for k in keys]
    local = [[9, 0, 10], [0, 11, 0]]
    for group, (lids, rids) in enumerate(zip(local, remote)):  # "read": copy the holder's blocks here
        for lb, rb in zip(lids, rids):
            if lb:
                for ref in cache.group_data_refs[group]:
                    row = cache.tensors[ref.tensor_idx].tensor
                    row[lb, ref.offset_bytes:ref.offset_bytes + ref.page_size_bytes] = \
                        row[rb, ref.offset_bytes:ref.offset_bytes + ref.page_size_bytes]
    assert mismatch(digests, local, remote, every, blob, keys) is None
    head1 = digests.units[1][1]
    ref = cache.group_data_refs[1][-1]
    cache.tensors[ref.tensor_idx].tensor[11, ref.offset_bytes + head1[1] + 3] ^= 1  # one bit of head 1, block 11
    assert mismatch(digests, local, remote, every, blob, keys) == "group 1, block 7 (position 1), head 1"
    only_head0 = [every[0], {keys[1][0]}]  # another rank read head 1: not this read's to check
    assert mismatch(digests, local, remote, only_head0, blob, keys) is None
    skipping = [[9, 0, 10], [0, 0, 0]]  # group 1's block not read (a hit here)
    assert mismatch(digests, skipping, remote, every, blob, keys) is None
    assert "are 8 bytes" in mismatch(digests, local, remote, every, blob[:8], keys)


def test_the_digest_of_a_multi_ref_group_covers_every_ref() -> None:
    alloc = allocate_kv_caches(CONFIG, "cpu", "per-layer")
    cache = alloc.describe()
    digests = BlockDigests(cache)
    before = digests.digest(0, 4, 0)
    last = cache.group_data_refs[0][-1]  # layer b
    cache.tensors[last.tensor_idx].tensor[4, last.offset_bytes] ^= 1
    assert len(cache.group_data_refs[0]) == 2 and digests.digest(0, 4, 0) != before
    assert np.uint64(digests.digest(0, 4, 0)) != 0
