"""A Gemma 3 decoder layer as direct native calls: the module path's kernels, without its
Python between them.

On a 2-core CPU the module path of a decode step spends about a third of its time in
Python around the kernels (Gemma 3 270M, batch 1: ~6 of ~18 ms), most of it per layer:
module calls, the checks each wrapper repeats on every call. `LayerPlan` is built once per
layer, after checking once what those calls would check (CPU, bfloat16 or float32, the
fused kernels built, per-head norms of one eps, an activation the kernel has, one rank);
each step then runs the layer's kernels in the module path's order on the same inputs
through the fused ops' unchecked entries (`fused.rms_norm_rows`, `qk_norm_rope_rows`), so
it computes the same bytes (tested, bitwise). Linears run their own `forward` (a GGUF,
int8 or packed bfloat16 one); attention runs its impl (the KV write and the
paged-attention kernel, or the torch path for a cache the kernel cannot read).

`Gemma3Model` uses the plans unless `use_native_layers(False)` was called (`pd bench step`
does, to time the parts with module hooks) or a layer's plan cannot be built; per step it
checks only the hidden states (`fused.supports`, 2-D, contiguous).
"""

from __future__ import annotations

import torch
from torch import nn

from pd.forward_context import get_forward_context
from pd.models import fused


class LayerPlan:
    """One Gemma 3 decoder layer (`Gemma3DecoderLayer`) as direct kernel calls for hidden
    states of `dtype`; `build` returns None where the module path must run instead."""

    def __init__(self, layer: nn.Module, dtype: torch.dtype) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.dtype = dtype
        self.norms = (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                      layer.post_feedforward_layernorm)
        self.qkv, self.o, self.gate_up, self.down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
        self.heads, self.kv_heads, self.head_size = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.q_norm, self.k_norm, self.rope = attn.q_norm, attn.k_norm, attn.rotary_emb
        self.attn = attn.attn
        self.activation = mlp.act_name

    @classmethod
    def build(cls, layer: nn.Module, dtype: torch.dtype) -> LayerPlan | None:
        attn, mlp = layer.self_attn, layer.mlp
        fits = (dtype in (torch.bfloat16, torch.float32) and fused.build()
                and attn.shard.size == 1 and mlp.shard.size == 1
                and mlp.act_name in fused.ACTIVATIONS
                and attn.q_norm.eps == attn.k_norm.eps
                and attn.rotary_emb.cos.device.type == "cpu" and attn.rotary_emb.cos.dtype == torch.float32
                and all(p.device.type == "cpu" for p in layer.parameters()))
        return cls(layer, dtype) if fits else None

    def __call__(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The layer's output for hidden states x (tokens, hidden) of the plan's dtype,
        contiguous, on CPU, at positions (tokens,) int64 contiguous (the caller checks)."""
        norms = self.norms
        self.rope._check(positions)  # an IndexError as the module path raises (the kernel refuses too)
        qkv = self.qkv.forward(fused.rms_norm_rows(x, norms[0].float_weight(), norms[0].eps))
        q, k = fused.qk_norm_rope_rows(qkv, self.heads, self.kv_heads, self.head_size, self.q_norm.float_weight(),
                                       self.k_norm.float_weight(), self.q_norm.eps, positions, self.rope.cos,
                                       self.rope.signed_sin)
        o = self.o.forward(self._attend(q, k, qkv[:, (self.heads + self.kv_heads) * self.head_size:]))
        x = fused.rms_norm_rows(o, norms[1].float_weight(), norms[1].eps, x)
        h = fused.rms_norm_rows(x, norms[2].float_weight(), norms[2].eps)
        d = self.down.forward(fused.act_mul(self.gate_up.forward(h), self.activation))
        return fused.rms_norm_rows(d, norms[3].float_weight(), norms[3].eps, x)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """`Attention.forward` without the module call: the KV write and attention of this
        layer's cache and metadata."""
        context, name, size = get_forward_context(), self.attn.layer_name, self.head_size
        out = self.attn.impl.forward(q.view(-1, self.heads, size), k.view(-1, self.kv_heads, size),
                                     v.view(-1, self.kv_heads, size), context.kv_caches[name].kv,
                                     context.attn_metadata[name])
        return out.reshape(-1, self.heads * size)
