"""The attention backend interface: a metadata builder and an implementation.

Per step and per KV cache group the model runner describes the batch once in a
`CommonAttentionMetadata` (query spans, sequence lengths, the group's block table and
slot mapping). Each attention group (one KV cache group x one backend x one sliding
window) owns a builder that turns it into the backend's metadata, shared by every layer
of the group. An implementation writes the step's K/V into the paged cache at
`slot_mapping` and attends over the request's blocks.

Token order in a batch: requests one after another, each request's new tokens in
position order; request i's tokens are `[query_start_loc[i], query_start_loc[i+1])`
and sit at positions `[num_computed_tokens[i], seq_lens[i])`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class CommonAttentionMetadata:
    """One KV cache group's view of the batch.

    Python lists (`*_cpu`) serve host-side loops; tensors live on the model's device.
    `block_table[i, j]` is the block holding positions `[j*block_size, (j+1)*block_size)`
    of request i (0, the null block, where the group no longer keeps them).
    `slot_mapping[t] = block * block_size + position % block_size` for each new token t.
    """

    query_start_loc_cpu: list[int]  # num_reqs + 1
    num_computed_tokens_cpu: list[int]  # num_reqs: tokens already in the cache
    seq_lens_cpu: list[int]  # num_reqs: num_computed + new tokens
    query_start_loc: torch.Tensor  # int32 (num_reqs + 1,)
    seq_lens: torch.Tensor  # int32 (num_reqs,)
    block_table: torch.Tensor  # int32 (num_reqs, max_blocks_per_req)
    slot_mapping: torch.Tensor  # int64 (num_tokens,)
    block_size: int

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_actual_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    def query_len(self, i: int) -> int:
        return self.query_start_loc_cpu[i + 1] - self.query_start_loc_cpu[i]

    @classmethod
    def from_requests(cls, block_rows: list[list[int]], num_computed: list[int], query_lens: list[int],
                      block_size: int, device: torch.device | str = "cpu") -> "CommonAttentionMetadata":
        """The batch described by per-request block rows, tokens already computed and new
        tokens (the model runner builds the same from its block tables; tests use this)."""
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        seq_lens = [c + n for c, n in zip(num_computed, query_lens)]
        width = max(1, max(len(r) for r in block_rows))
        slots = [row[p // block_size] * block_size + p % block_size
                 for row, c, s in zip(block_rows, num_computed, seq_lens) for p in range(c, s)]
        return cls(
            query_start_loc_cpu=starts, num_computed_tokens_cpu=list(num_computed), seq_lens_cpu=seq_lens,
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_table=torch.tensor([r + [0] * (width - len(r)) for r in block_rows], dtype=torch.int32,
                                     device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_size=block_size,
        )


class AttentionMetadataBuilder(ABC):
    """Builds one attention group's metadata once per step."""

    def __init__(self, sliding_window: int | None, device: torch.device) -> None:
        self.sliding_window = sliding_window
        self.device = device

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> Any:
        """The metadata every layer of this attention group reads this step."""


class AttentionImpl(ABC):
    """One layer's attention over the paged KV cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 sliding_window: int | None) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not split over {num_kv_heads} KV heads")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.sliding_window = sliding_window

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: Any) -> torch.Tensor:
        """query (T, H, D), key/value (T, KVH, D), kv_cache (num_blocks, 2, block_size, KVH, D)
        -> output (T, H, D). Writes key/value into the cache first, then attends causally
        (and within the sliding window) over each request's cached and new tokens."""


class AttentionBackend(ABC):
    name: str

    @staticmethod
    @abstractmethod
    def builder_cls() -> type[AttentionMetadataBuilder]: ...

    @staticmethod
    @abstractmethod
    def impl_cls() -> type[AttentionImpl]: ...
