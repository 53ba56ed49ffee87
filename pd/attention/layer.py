"""The attention layer models call: projections in, attention over the paged cache out."""

from __future__ import annotations

import torch
from torch import nn

from pd.attention import get_attention_backend
from pd.forward_context import get_forward_context
from pd.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec


class Attention(nn.Module):
    """Paged attention for one layer, named `layer_name` in the KV cache config.

    `sliding_window` (tokens a query sees, itself included) is a property of the layer,
    not of its KV cache group: in non-hybrid mode a sliding layer keeps blocks for all
    tokens in a full-attention group yet still attends only within its window.
    """

    def __init__(self, layer_name: str, num_heads: int, num_kv_heads: int, head_size: int,
                 scale: float, sliding_window: int | None = None, backend: str = "torch") -> None:
        super().__init__()
        self.layer_name = layer_name
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.sliding_window = sliding_window
        self.backend = get_attention_backend(backend)
        self.impl = self.backend.impl_cls()(num_heads, num_kv_heads, head_size, scale, sliding_window)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query (T, H*D), key/value (T, KVH*D) -> (T, H*D)."""
        context = get_forward_context()
        out = self.impl.forward(
            query.view(-1, self.num_heads, self.head_size),
            key.view(-1, self.num_kv_heads, self.head_size),
            value.view(-1, self.num_kv_heads, self.head_size),
            context.kv_caches[self.layer_name].kv,
            context.attn_metadata[self.layer_name],
        )
        return out.reshape(-1, self.num_heads * self.head_size)

    def kv_cache_spec(self, block_size: int, dtype: str, hybrid: bool = True) -> FullAttentionSpec:
        """This layer's spec. With `hybrid=False` a sliding layer reports full attention
        (its KV is kept for every token) so all attention layers share one group type."""
        common = dict(block_size=block_size, num_kv_heads=self.num_kv_heads,
                      head_size=self.head_size, dtype=dtype)
        if self.sliding_window is not None and hybrid:
            return SlidingWindowSpec(sliding_window=self.sliding_window, **common)
        return FullAttentionSpec(**common)
