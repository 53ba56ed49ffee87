"""Paged attention in plain torch (device-agnostic, the reference), and on CPU the
native kernel (`cpu_kernels`, `pd/csrc/paged_attention.c`).

Per step the builder turns one attention group's `CommonAttentionMetadata` into
`TorchAttentionMetadata`, shared by every layer of the group: where each new token's
K/V goes, and, built once by the first layer that needs them, either the whole step as
the native kernel's tiles (CPU caches in bfloat16 or float32: a layer's forward is a
write and one kernel call for every query, prefill or decode, no mask), or for the torch
path the single-token (decode) requests as one padded gather and the multi-token
(prefill or chunked-prefill) requests one by one (a layer's forward is a write, one
batched decode attention and one `scaled_dot_product_attention` per prefill).

Window rule: a query at position p sees keys at positions `[max(0, p - W + 1), p]`
(`W` = sliding window, itself included); without a window it sees `[0, p]`. Only blocks
holding visible positions are read, so block-table entries before a request's window
may be the null block or stale ids.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pd.attention import cpu_kernels
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
    """The single-token requests, gathered together block by block.

    Row d reads `blocks_per_req` whole blocks, from the first block holding a key its
    query sees; rows with fewer repeat their last block. Key slot j of row d is token
    `j % block_size` of its `j // block_size`-th block. `hidden[d, j]` says whether the
    query does not see that key (not causal, or out of window). Hidden keys get no weight
    and their gathered values are zeroed (`hidden_slots`, flat indices into the
    num_decodes x keys slots): an unwritten slot may hold anything, even NaN.
    """

    token_indices: torch.Tensor  # int64 (num_decodes,): batch rows of the decode tokens
    blocks: torch.Tensor  # int64 (num_decodes * blocks_per_req,): block ids, row-major
    blocks_per_req: int
    hidden: torch.Tensor  # bool (num_decodes, blocks_per_req * block_size)
    workspace: Workspace

    @functools.cached_property
    def hidden_slots(self) -> torch.Tensor:
        """int64: flat indices of the True entries of `hidden`; found once per step, by
        the first layer."""
        return self.hidden.flatten().nonzero()[:, 0]


@dataclass
class Workspace:
    """Scratch buffers that outlive a step: the native kernel's scores and vectors, or a
    decode's gathered keys, values and scores. Every layer of a group takes the same
    buffers (layers run one after another), so a steady decode allocates nothing: a
    buffer grows to the largest batch seen (by half again, so a slowly growing context
    does not reallocate each step) and is never handed back. Freeing and re-faulting
    multi-MB temporaries each step cost more than the attention's arithmetic on CPU."""

    buffers: dict[tuple[str, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self.buffers.get((name, dtype))
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel + numel // 2, dtype=dtype, device=device)
            self.buffers[(name, dtype)] = buffer
        return buffer[:numel].view(shape)


@dataclass(frozen=True)
class NativeTiles:
    """The whole step as the native kernel's tiles: each decode one tile, each prefill
    chunk tiles of up to `TILE_TOKENS` consecutive tokens. `tiles` int64 (n, 4): first
    batch row, tokens, block-table row, position of the first token; `max_span` bounds
    any tile's keys (its last position - its first token's first visible + 1)."""

    tiles: torch.Tensor
    max_tile: int
    max_span: int
    table: torch.Tensor  # int32, contiguous: the group's block table


TILE_TOKENS = 8
FP8 = (torch.float8_e4m3fn,)  # 8-bit caches (--kv-cache-dtype fp8_e4m3): written saturated, read widened
FP8_MAX = 448.0
SCALED = torch.int8  # --kv-cache-dtype int8: each row head_size int8 values, then its float32 scale


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) -> int8 rows (..., D + 4): round(x / s), then s = max|x| / 127 (1 for a
    zero row) as float32 bytes."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def widen_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows (..., D) as `dtype`; int8 rows (..., D + 4) times their scales."""
    if rows.dtype != SCALED:
        return rows.to(dtype)
    scales = rows[..., -4:].contiguous().view(torch.float32)
    return (rows[..., :-4].float() * scales).to(dtype)


@dataclass(frozen=True)
class TorchAttentionMetadata:
    """One attention group's step, read by every layer of the group.

    `slot_blocks[t]`, `slot_offsets[t]`: where new token t's K/V is written (the first
    `num_actual_tokens` rows; rows after that are padding, neither written nor attended).
    The rest is built on first use, by the first layer, for the path its cache takes:
    `tiles` for the native CPU kernel, `decodes` and `prefills` for the torch path.
    """

    num_actual_tokens: int
    sliding_window: int | None
    slot_blocks: torch.Tensor  # int64 (num_actual_tokens,)
    slot_offsets: torch.Tensor  # int64 (num_actual_tokens,)
    common: CommonAttentionMetadata
    builder: TorchAttentionMetadataBuilder

    @functools.cached_property
    def decodes(self) -> DecodeBatch | None:
        reqs = [i for i in range(self.common.num_reqs) if self.common.query_len(i) == 1]
        return self.builder._decodes(self.common, reqs) if reqs else None

    @functools.cached_property
    def prefills(self) -> list[PrefillSlice]:
        return [self.builder._prefill(self.common, i) for i in range(self.common.num_reqs)
                if self.common.query_len(i) > 1]

    @functools.cached_property
    def tiles(self) -> NativeTiles:
        return self.builder._tiles(self.common)

    @property
    def workspace(self) -> Workspace:
        return self.builder.workspace


class TorchAttentionMetadataBuilder(AttentionMetadataBuilder):
    """Builds `TorchAttentionMetadata`; `sliding_window` is the group's layers' window.
    Owns the group's decode workspace."""

    def __init__(self, sliding_window: int | None, device: torch.device) -> None:
        super().__init__(sliding_window, device)
        self.workspace = Workspace()

    def build(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        n = common.num_actual_tokens
        slots = common.slot_mapping[:n].to(device=self.device, dtype=torch.int64)
        return TorchAttentionMetadata(
            num_actual_tokens=n,
            sliding_window=self.sliding_window,
            slot_blocks=slots // common.block_size,
            slot_offsets=slots % common.block_size,
            common=common,
            builder=self,
        )

    def _tiles(self, common: CommonAttentionMetadata) -> NativeTiles:
        rows, max_span, max_tile = [], 1, 1
        for i in range(common.num_reqs):
            start, end = common.query_start_loc_cpu[i], common.query_start_loc_cpu[i + 1]
            computed = common.num_computed_tokens_cpu[i]
            for first in range(0, end - start, TILE_TOKENS):
                m = min(TILE_TOKENS, end - start - first)
                pos = computed + first
                rows += (start + first, m, i, pos)
                max_span, max_tile = max(max_span, pos + m - self._first_visible(pos)), max(max_tile, m)
        tiles = torch.tensor(rows, dtype=torch.int64).view(-1, 4)
        return NativeTiles(tiles=tiles, max_tile=max_tile, max_span=max_span,
                           table=common.block_table.to(torch.int32).contiguous())

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
        bs = common.block_size
        positions = [common.seq_lens_cpu[i] - 1 for i in reqs]
        first_cols = [self._first_visible(p) // bs for p in positions]
        per_req = max(p // bs - f + 1 for p, f in zip(positions, first_cols))
        host = torch.tensor([reqs, [common.query_start_loc_cpu[i] for i in reqs], positions, first_cols])
        rows, token_indices, pos, first_col = host.to(self.device).unbind(0)
        cols = torch.minimum(first_col[:, None] + torch.arange(per_req, device=self.device), (pos // bs)[:, None])
        blocks = common.block_table.to(self.device)[rows[:, None], cols].to(torch.int64)
        key_pos = first_col[:, None] * bs + torch.arange(per_req * bs, device=self.device)[None, :]
        hidden = key_pos > pos[:, None]
        if self.sliding_window is not None:
            hidden |= key_pos <= pos[:, None] - self.sliding_window
        return DecodeBatch(token_indices=token_indices, blocks=blocks.flatten(), blocks_per_req=per_req, hidden=hidden,
                           workspace=self.workspace)


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
        if cpu_kernels.supports(kv_cache) and query.device.type == "cpu":
            return self._native(query, kv_cache, metadata)
        out = query.new_empty(query.shape)
        out[n:] = 0
        if metadata.decodes is not None:
            out[metadata.decodes.token_indices] = self._decode_gathered(query, kv_cache, metadata.decodes)
        for p in metadata.prefills:
            out[p.query_start : p.query_end] = self._prefill(query[p.query_start : p.query_end], kv_cache, p)
        return out

    @staticmethod
    def _write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
               metadata: TorchAttentionMetadata) -> None:
        """Scatter by (block, offset): the cache may be a strided view, never flattened."""
        blocks, offsets = metadata.slot_blocks, metadata.slot_offsets
        if cpu_kernels.write_kv(key, value, kv_cache, blocks, offsets):
            return
        if kv_cache.dtype in FP8:  # saturated at the format's largest finite value, never NaN for a finite input
            key, value = key.clamp(-FP8_MAX, FP8_MAX), value.clamp(-FP8_MAX, FP8_MAX)
        elif kv_cache.dtype == SCALED:
            key, value = quantize_rows(key), quantize_rows(value)
        kv_cache[blocks, 0, offsets] = key.to(kv_cache.dtype)
        kv_cache[blocks, 1, offsets] = value.to(kv_cache.dtype)

    def _prefill(self, query: torch.Tensor, kv_cache: torch.Tensor, p: PrefillSlice) -> torch.Tensor:
        """query (q_len, H, D) -> (q_len, H, D) over the request's visible keys."""
        keys = slice(p.key_offset, p.key_offset + p.key_len)
        k = widen_rows(kv_cache[p.block_ids, 0].flatten(0, 1)[keys], query.dtype)
        v = widen_rows(kv_cache[p.block_ids, 1].flatten(0, 1)[keys], query.dtype)
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=p.mask, is_causal=p.mask is None, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out[0].transpose(0, 1)

    def _native(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: TorchAttentionMetadata) -> torch.Tensor:
        """Every query of the step in one call of the native kernel (each visible key and
        value read in place, once per tile)."""
        n, tiles = metadata.num_actual_tokens, metadata.tiles
        dtype = query.dtype if kv_cache.dtype in (*FP8, SCALED) else kv_cache.dtype  # the kernel's queries, outputs
        out = torch.empty(query.shape, dtype=dtype)
        if n < query.shape[0]:
            out[n:] = 0
        if n and tiles.tiles.numel():
            group = self.num_heads // self.num_kv_heads
            size = cpu_kernels.scratch_size(group * tiles.max_tile, self.head_size, tiles.max_span)
            scratch = metadata.workspace.take("scratch", (size,), torch.float32, query.device)
            whole = n == query.shape[0] and query.dtype == dtype and query.is_contiguous()
            cpu_kernels.paged_attention(query if whole else query[:n].to(dtype).contiguous(), kv_cache, tiles.table,
                                        tiles.tiles, tiles.max_tile, self.sliding_window, self.scale,
                                        out if whole else out[:n], scratch, tiles.max_span)
        return out if out.dtype == query.dtype else out.to(query.dtype)

    def _decode_gathered(self, query: torch.Tensor, kv_cache: torch.Tensor, d: DecodeBatch) -> torch.Tensor:
        """All decode queries at once -> (num_decodes, H, D), on any device.

        Per KV head, the rows' blocks are gathered into the workspace (each cached byte
        read once, written once), keys widened to float32 in place of a temporary; the
        query heads sharing a KV head are batched against them: scores and softmax in
        float32, then the values in the cache dtype. Only scores are masked; hidden
        values are zeroed in the workspace, slot by slot.
        """
        n, kvh, size = d.token_indices.numel(), self.num_kv_heads, self.head_size
        group, keys = self.num_heads // kvh, d.hidden.shape[1]
        ws, device = d.workspace, query.device
        row = kv_cache.shape[-1]  # size, or size + 4 for int8 rows and their scales
        k = ws.take("k", (kvh, n * d.blocks_per_req, kv_cache.shape[2], row), kv_cache.dtype, device)
        v = ws.take("v", k.shape, kv_cache.dtype, device)
        for h in range(kvh):
            torch.index_select(kv_cache[:, 0, :, h], 0, d.blocks, out=k[h])
            torch.index_select(kv_cache[:, 1, :, h], 0, d.blocks, out=v[h])
        if kv_cache.dtype == SCALED:
            k32 = widen_rows(k, torch.float32).view(kvh, n, keys, size)
            v = widen_rows(v, query.dtype)
        else:
            k32 = k.view(kvh, n, keys, size)
            if k32.dtype != torch.float32:
                k32 = ws.take("k32", k32.shape, torch.float32, device).copy_(k32)
            if v.dtype in FP8:  # values weighed in the model's dtype
                v = ws.take("v16", v.shape, query.dtype, device).copy_(v)
        v = v.view(kvh, n * keys, size).index_fill_(1, d.hidden_slots, 0).view(kvh, n, keys, size)
        q = query[d.token_indices].view(n, kvh, group, size).transpose(0, 1).float()
        scores_out = ws.take("scores", (kvh, n, group, keys), torch.float32, device)
        scores = torch.matmul(q, k32.transpose(2, 3), out=scores_out)
        scores.mul_(self.scale).masked_fill_(d.hidden[None, :, None, :], float("-inf"))
        probs = scores.softmax(-1).to(v.dtype)
        out = torch.matmul(probs, v)  # (kvh, n, group, D)
        return out.transpose(0, 1).reshape(n, self.num_heads, size).to(query.dtype)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    @staticmethod
    def builder_cls() -> type[AttentionMetadataBuilder]:
        return TorchAttentionMetadataBuilder

    @staticmethod
    def impl_cls() -> type[AttentionImpl]:
        return TorchAttentionImpl
