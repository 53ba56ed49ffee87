"""The native attention kernel's own guards (its results are held against the reference
in test_torch_backend.py)."""

import pytest
import torch

from pd.attention import cpu_kernels


@pytest.mark.parametrize("bad", ["too_many_tokens", "past_batch", "table_row", "past_table", "span", "negative"])
def test_native_kernel_refuses_tiles_out_of_bounds(bad) -> None:
    """The kernel follows raw pointers: a tile past the batch, the block table or the
    span its scratch was sized for is refused (ValueError) before anything is read."""
    assert cpu_kernels._library() is not None, "the native attention kernel did not build"
    bs, kvh, size, heads = 4, 1, 8, 2
    cache = torch.randn(9, 2, bs, kvh, size)
    table = torch.arange(1, 9, dtype=torch.int32).view(2, 4)  # 2 requests x 16 positions
    q = torch.randn(6, heads, size)
    good = [0, 3, 0, 5]  # tokens 0-2 at positions 5-7 of request 0
    tile = {"too_many_tokens": [0, 5, 0, 0], "past_batch": [4, 3, 0, 0], "table_row": [0, 3, 2, 0],
            "past_table": [0, 3, 1, 14], "span": [0, 3, 0, 9], "negative": [0, 3, 0, -1]}[bad]
    span, max_tile = 10, 4
    scratch = torch.empty(cpu_kernels.scratch_size(heads * max_tile, size, 16))
    out = torch.empty_like(q)
    ok = torch.tensor([good], dtype=torch.int64)
    cpu_kernels.paged_attention(q, cache, table, ok, max_tile, None, 0.5, out, scratch, span)
    with pytest.raises(ValueError, match="refused"):
        cpu_kernels.paged_attention(q, cache, table, torch.tensor([good, tile], dtype=torch.int64), max_tile, None,
                                    0.5, out, scratch, span)
