"""build_mamba_metadata: which state block each request reads and which it writes."""

from __future__ import annotations

import random

import pytest
import torch

from pd.attention.backend import CommonAttentionMetadata
from pd.attention.mamba_metadata import build_mamba_metadata

BS = 16  # block size


def _common(rows: list[list[int]], computed: list[int], lens: list[int]) -> CommonAttentionMetadata:
    return CommonAttentionMetadata.from_requests(rows, computed, lens, BS)


def test_metadata_against_brute_force_oracle():
    rng = random.Random(7)
    for _ in range(300):
        computed = rng.choice([0, rng.randrange(1, 80), BS * rng.randrange(1, 5)])
        n = rng.choice([1, rng.randrange(1, 70)])
        row = rng.sample(range(1, 500), -(-(computed + n) // BS))
        meta = build_mamba_metadata(_common([row], [computed], [n]), "cpu")
        want_writes = [(t, row[(computed + t) // BS - 1]) for t in range(1, n + 1) if (computed + t) % BS == 0]
        if not want_writes or want_writes[-1][0] != n:
            want_writes.append((n, row[(computed + n - 1) // BS]))
        want_read = row[(computed - 1) // BS] if computed else None
        if n == 1:
            assert meta.prefills == [] and meta.num_decodes == 1
            assert meta.decode_read_blocks.tolist() == [want_read or 0]
            assert meta.decode_has_state.tolist() == [want_read is not None]
            assert meta.decode_write_blocks.tolist() == [want_writes[0][1]]
        else:
            (req,) = meta.prefills
            assert (req.read_block, list(req.writes), req.query_len) == (want_read, want_writes, n)
            assert meta.num_decodes == 0


def test_metadata_splits_a_batch_and_drops_null_boundary_writes():
    rows = [[5, 9], [0, 7, 3, 4], [2]]
    meta = build_mamba_metadata(_common(rows, [20, 0, 0], [1, 50, 3]), "cpu")
    assert meta.decode_token_indices.tolist() == [0] and meta.decode_write_blocks.tolist() == [9]
    long, short = meta.prefills
    assert (long.query_start, long.read_block, long.writes) == (1, None, ((32, 7), (48, 3), (50, 4)))
    assert (short.query_start, short.writes) == (51, ((3, 2),))
    host = build_mamba_metadata(_common(rows, [20, 0, 0], [1, 50, 3]), "cpu",
                                block_table_cpu=torch.tensor([[5, 9, 0, 0], [0, 7, 3, 4], [2, 0, 0, 0]]))
    assert host.prefills == meta.prefills and torch.equal(host.decode_write_blocks, meta.decode_write_blocks)
    with pytest.raises(ValueError, match="null block"):
        build_mamba_metadata(_common([[0, 6]], [16], [4]), "cpu")
