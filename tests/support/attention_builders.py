"""What the attention tests build more than once: the native kernel they require, torch's
thread count for a block of work, a small batch of tiles the kernel runs over, and rows of
K and V as a layer hands them to the cache writer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from pd.attention import cpu_kernels


def require_native_kernel() -> None:
    """The native kernel must have been built: a machine with a C compiler that cannot
    build it is a failure, not a skip."""
    assert cpu_kernels._library() is not None, "the native attention kernel did not build"


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch runs on `n` threads inside the block; the count before is put back however
    it ends."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class ChunkAndTwoDecodes:
    """Two requests over a 9-block cache (blocks 1-4 and 5-8 in the table) and five query
    tokens in three tiles: a 3-token chunk of request 0 at positions 9-11, a decode of
    request 1 at position 13 and one of request 0 at position 2."""

    num_tokens: ClassVar[int] = 5
    max_tile: ClassVar[int] = 3
    span: ClassVar[int] = 16  # positions a request's table covers

    heads: int
    kv_heads: int
    head_size: int

    def attend(self, q: torch.Tensor, cache: torch.Tensor, window: int | None = None,
               scale: float = 0.3) -> torch.Tensor:
        """The native kernel's output for queries `q` (num_tokens rows) over `cache`."""
        table = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int32)
        tiles = torch.tensor([[0, 3, 0, 9], [3, 1, 1, 13], [4, 1, 0, 2]], dtype=torch.int64)
        scratch = torch.empty(cpu_kernels.scratch_size((self.heads // self.kv_heads) * self.max_tile,
                                                       self.head_size, self.span))
        out = torch.empty_like(q)
        cpu_kernels.paged_attention(q, cache, table, tiles, self.max_tile, window, scale, out, scratch, self.span)
        return out


@dataclass
class RowsToWrite:
    """One step's K and V rows and where they go: K contiguous (as RoPE returns it), V a
    strided slice of the fused qkv projection; token i to block `blocks[i]`, offset
    `offsets[i]`."""

    key: torch.Tensor  # (tokens, kv_heads, head_size)
    value: torch.Tensor
    blocks: torch.Tensor
    offsets: torch.Tensor


def rows_to_write(kv_heads: int, head_size: int, dtype: torch.dtype, gen: torch.Generator,
                  scale: float = 1.0) -> RowsToWrite:
    """Five tokens' rows (of a layer with 4 query heads) for blocks of at least 4 slots
    in a cache of at least 8 blocks, two of them in one block."""
    tokens, heads = 5, 4
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=gen) * scale).to(dtype)
    key = qkv[:, heads * head_size: (heads + kv_heads) * head_size].view(tokens, kv_heads, head_size).clone()
    value = qkv[:, (heads + kv_heads) * head_size:].view(tokens, kv_heads, head_size)
    return RowsToWrite(key, value, torch.tensor([3, 3, 7, 1, 5]), torch.tensor([0, 3, 2, 1, 0]))
