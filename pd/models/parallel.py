"""The sharded layers of tensor parallelism (`pd/distributed/shard.py`).

Each layer holds one rank's slice and says, in `shard_source(leaf, index, published)`,
which part of a published weight that is, so a checkpoint loads unchanged on every
rank (`CausalLM.load_weights` narrows each weight before copying it):

- column-parallel: `MergedLinear` with `source_rows`, one slice of output rows per
  published part (q / k / v by heads, gate / up by channels);
- row-parallel: `RowParallelLinear`, a slice of input columns; its output is a partial
  sum the caller all-reduces (`tp_reduce`), a call outside the layer so that packed and
  int8 forwards, which replace a linear's forward, keep it; its bias lives on rank 0;
- vocabulary-parallel: `VocabParallelEmbedding` and `ParallelLMHead`, `ceil(vocab /
  size)` rows each (zero padded), the embedding summed over ranks, the logits gathered.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pd.distributed.collectives import all_gather, all_reduce
from pd.distributed.shard import TPShard

# A published weight: a tensor, or a lazy slice of a safetensors file (`safe_open(...).get_slice`)
# that reads only the rows or columns it is indexed with, so a rank never reads all of a
# sharded weight.
Published = Any


def head_rows(shard: TPShard, heads: int, head_size: int, replicated: bool = False) -> slice:
    """The published rows of this rank's heads (`head_size` rows each)."""
    first, count = shard.replicated_split(heads, "heads") if replicated else shard.split(heads, "heads")
    return slice(first * head_size, (first + count) * head_size)


class RowParallelLinear(nn.Linear):
    """`out = x[:, cols] @ W[:, cols].T` on each rank; the sum over ranks (`tp_reduce`)
    is the unsharded layer's output. The bias is added once, by rank 0."""

    def __init__(self, in_features: int, out_features: int, shard: TPShard, bias: bool = False,
                 unit: int = 1) -> None:
        first, count = shard.split(in_features // unit, "input units")
        super().__init__(count * unit, out_features, bias=bias)
        self.source_cols = slice(first * unit, (first + count) * unit)
        self.shard = shard

    def shard_source(self, leaf: str, index: int | None, published: Published) -> torch.Tensor:
        if leaf == "weight":
            return published[:, self.source_cols]
        bias = published[:]
        return bias if self.shard.rank == 0 else torch.zeros_like(bias)


def tp_reduce(x: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """A row-parallel layer's output summed over the ranks."""
    return all_reduce(x, shard)


class VocabParallelEmbedding(nn.Embedding):
    """Rows `[first, first + rows)` of the vocabulary, padded to `ceil(vocab / size)`."""

    def __init__(self, vocab_size: int, hidden: int, shard: TPShard) -> None:
        per_rank = -(-vocab_size // shard.size)
        super().__init__(per_rank, hidden)
        self.first, self.rows = shard.rows(vocab_size)
        self.vocab_size, self.shard = vocab_size, shard

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return super().forward(ids)
        local = ids - self.first
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return tp_reduce(out.masked_fill_(outside[:, None], 0), self.shard)

    def shard_source(self, leaf: str, index: int | None, published: Published) -> torch.Tensor:
        return _pad_rows(published[self.first : self.first + self.rows], self.weight.shape[0])


class ParallelLMHead(nn.Linear):
    """The logits of this rank's vocabulary rows; `logits` gathers them all."""

    def __init__(self, hidden: int, vocab_size: int, shard: TPShard) -> None:
        super().__init__(hidden, -(-vocab_size // shard.size), bias=False)
        self.first, self.rows = shard.rows(vocab_size)
        self.vocab_size, self.shard = vocab_size, shard

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(T, hidden) -> (T, vocab), every rank's rows joined."""
        return all_gather(self(hidden), self.shard)[:, : self.vocab_size]

    def shard_source(self, leaf: str, index: int | None, published: Published) -> torch.Tensor:
        return _pad_rows(published[self.first : self.first + self.rows], self.weight.shape[0])


def _pad_rows(rows: torch.Tensor, n: int) -> torch.Tensor:
    if rows.shape[0] == n:
        return rows
    return torch.cat([rows, rows.new_zeros(n - rows.shape[0], *rows.shape[1:])])


def narrow_published(module: nn.Module, leaf: str, index: int | None, published: Published) -> Published:
    """The part of a published weight `module` holds (all of it unless sharded)."""
    source = getattr(module, "shard_source", None)
    return published if source is None else source(leaf, index, published)
