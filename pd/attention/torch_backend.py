"""Paged attention in plain torch: device-agnostic, the reference backend.

Per step the builder turns one attention group's `CommonAttentionMetadata` into
`TorchAttentionMetadata`, shared by every layer of the group: where each new token's
K/V goes, the single-token (decode) requests as one padded gather, and the multi-token
(prefill or chunked-prefill) requests one by one. Everything that depends only on the
batch (gather indices, masks) is computed there once, so a layer's forward is a write,
one batched decode attention and one `scaled_dot_product_attention` per prefill.

Window rule: a query at position p sees keys at positions `[max(0, p - W + 1), p]`
(`W` = sliding window, itself included); without a window it sees `[0, p]`. Only blocks
holding visible positions are read, so block-table entries before a request's window
may be the null block or stale ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pd.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)


@dataclass(frozen=True)
class PrefillSlice:
    """One request computing several tokens: batch rows `[query_start, query_end)`.

    Its visible keys are tokens `[key_offset, key_offset + key_len)` of the blocks
    `block_ids` laid end to end. `mask` (query_len, key_len), True = attend; None means
    plain causal attention (no cached prefix, and the window never excludes a key).
    The mask is materialized once per step for the whole group: query_len x key_len bools.
    """

    query_start: int
    query_end: int
    block_ids: torch.Tensor  # int64 (num_blocks,): the block-table columns it reads
    key_offset: int
    key_len: int
    mask: torch.Tensor | None


@dataclass(frozen=True)
class DecodeBatch:
    """The single-token requests, gathered together.

    Row d gathers the key positions its query sees, left-aligned and padded to
    `max_len`: `(blocks[d, j], offsets[d, j])` is the cache slot of its j-th key.
    Padding repeats the query's own slot (always written) and is masked out by `mask`.
    """

    token_indices: torch.Tensor  # int64 (num_decodes,): batch rows of the decode tokens
    blocks: torch.Tensor  # int64 (num_decodes, max_len)
    offsets: torch.Tensor  # int64 (num_decodes, max_len)
    mask: torch.Tensor  # bool (num_decodes, 1, 1, max_len), True = attend


@dataclass(frozen=True)
class TorchAttentionMetadata:
    """One attention group's step, read by every layer of the group.

    `slot_blocks[t]`, `slot_offsets[t]`: where new token t's K/V is written (the first
    `num_actual_tokens` rows; rows after that are padding, neither written nor attended).
    """

    num_actual_tokens: int
    sliding_window: int | None
    slot_blocks: torch.Tensor  # int64 (num_actual_tokens,)
    slot_offsets: torch.Tensor  # int64 (num_actual_tokens,)
    decodes: DecodeBatch | None
    prefills: list[PrefillSlice]


class TorchAttentionMetadataBuilder(AttentionMetadataBuilder):
    """Builds `TorchAttentionMetadata`; `sliding_window` is the group's layers' window."""

    def build(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        n = common.num_actual_tokens
        slots = common.slot_mapping[:n].to(device=self.device, dtype=torch.int64)
        decode_reqs = [i for i in range(common.num_reqs) if common.query_len(i) == 1]
        prefills = [self._prefill(common, i) for i in range(common.num_reqs) if common.query_len(i) > 1]
        return TorchAttentionMetadata(
            num_actual_tokens=n,
            sliding_window=self.sliding_window,
            slot_blocks=slots // common.block_size,
            slot_offsets=slots % common.block_size,
            decodes=self._decodes(common, decode_reqs) if decode_reqs else None,
            prefills=prefills,
        )

    def _first_visible(self, position: int) -> int:
        """The earliest key position a query at `position` sees."""
        if self.sliding_window is None:
            return 0
        return max(0, position - self.sliding_window + 1)

    def _prefill(self, common: CommonAttentionMetadata, i: int) -> PrefillSlice:
        start, end = common.query_start_loc_cpu[i], common.query_start_loc_cpu[i + 1]
        computed, seq_len, bs = common.num_computed_tokens_cpu[i], common.seq_lens_cpu[i], common.block_size
        first = self._first_visible(computed)  # the earliest new query sees the most
        first_col, last_col = first // bs, (seq_len - 1) // bs
        block_ids = common.block_table[i, first_col : last_col + 1].to(device=self.device, dtype=torch.int64)
        plain_causal = computed == 0 and (self.sliding_window is None or end - start <= self.sliding_window)
        return PrefillSlice(
            query_start=start,
            query_end=end,
            block_ids=block_ids,
            key_offset=first - first_col * bs,
            key_len=seq_len - first,
            mask=None if plain_causal else self._prefill_mask(computed, first, seq_len),
        )

    def _prefill_mask(self, computed: int, first: int, seq_len: int) -> torch.Tensor:
        """(queries at [computed, seq_len)) x (keys at [first, seq_len)): causal and in window."""
        q_pos = torch.arange(computed, seq_len, device=self.device)[:, None]
        k_pos = torch.arange(first, seq_len, device=self.device)[None, :]
        mask = k_pos <= q_pos
        if self.sliding_window is not None:
            mask &= k_pos > q_pos - self.sliding_window
        return mask

    def _decodes(self, common: CommonAttentionMetadata, reqs: list[int]) -> DecodeBatch:
        positions = [common.seq_lens_cpu[i] - 1 for i in reqs]
        firsts = [self._first_visible(p) for p in positions]
        max_len = max(p - f + 1 for p, f in zip(positions, firsts))
        host = torch.tensor([reqs, [common.query_start_loc_cpu[i] for i in reqs], positions, firsts])
        rows, token_indices, pos, first = host.to(self.device).unbind(0)
        j = torch.arange(max_len, device=self.device)[None, :]
        key_pos = first[:, None] + j
        valid = key_pos <= pos[:, None]
        key_pos = torch.where(valid, key_pos, pos[:, None])  # padding: the query's own slot
        table = common.block_table.to(self.device)
        return DecodeBatch(
            token_indices=token_indices,
            blocks=table[rows[:, None], key_pos // common.block_size].to(torch.int64),
            offsets=key_pos % common.block_size,
            mask=valid[:, None, None, :],
        )


class TorchAttentionImpl(AttentionImpl):
    """Writes the step's K/V into the paged cache, then attends (see the module doc).

    Softmax runs in float32 inside `scaled_dot_product_attention` for 16-bit inputs;
    the output has the query's dtype.
    """

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: TorchAttentionMetadata) -> torch.Tensor:
        if metadata.sliding_window != self.sliding_window:
            raise ValueError(f"metadata built for sliding window {metadata.sliding_window}, "
                             f"layer has {self.sliding_window}")
        n = metadata.num_actual_tokens
        self._write(key[:n], value[:n], kv_cache, metadata)
        out = query.new_empty(query.shape)
        out[n:] = 0
        if metadata.decodes is not None:
            out[metadata.decodes.token_indices] = self._decode(query, kv_cache, metadata.decodes)
        for p in metadata.prefills:
            out[p.query_start : p.query_end] = self._prefill(query[p.query_start : p.query_end], kv_cache, p)
        return out

    @staticmethod
    def _write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
               metadata: TorchAttentionMetadata) -> None:
        """Scatter by (block, offset): the cache may be a strided view, never flattened."""
        blocks, offsets = metadata.slot_blocks, metadata.slot_offsets
        kv_cache[blocks, 0, offsets] = key.to(kv_cache.dtype)
        kv_cache[blocks, 1, offsets] = value.to(kv_cache.dtype)

    def _prefill(self, query: torch.Tensor, kv_cache: torch.Tensor, p: PrefillSlice) -> torch.Tensor:
        """query (q_len, H, D) -> (q_len, H, D) over the request's visible keys."""
        keys = slice(p.key_offset, p.key_offset + p.key_len)
        k = kv_cache[p.block_ids, 0].flatten(0, 1)[keys].to(query.dtype)
        v = kv_cache[p.block_ids, 1].flatten(0, 1)[keys].to(query.dtype)
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=p.mask, is_causal=p.mask is None, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out[0].transpose(0, 1)

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, d: DecodeBatch) -> torch.Tensor:
        """All decode queries at once -> (num_decodes, H, D).

        The query heads sharing a KV head stand in for SDPA's query length, so grouped
        heads need no repeated K/V: q (N, KVH, G, D) against k, v (N, KVH, max_len, D).
        """
        n, group = d.token_indices.numel(), self.num_heads // self.num_kv_heads
        q = query[d.token_indices].view(n, self.num_kv_heads, group, self.head_size)
        k = kv_cache[d.blocks, 0, d.offsets].to(query.dtype).transpose(1, 2)
        v = kv_cache[d.blocks, 1, d.offsets].to(query.dtype).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=d.mask, scale=self.scale)
        return out.reshape(n, self.num_heads, self.head_size)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    @staticmethod
    def builder_cls() -> type[AttentionMetadataBuilder]:
        return TorchAttentionMetadataBuilder

    @staticmethod
    def impl_cls() -> type[AttentionImpl]:
        return TorchAttentionImpl
