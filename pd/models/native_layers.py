"""A Gemma 3 decoder layer as direct native calls: the module path's kernels, without its
Python between them.

On a 2-core CPU the module path of a decode step spends about a third of its time in
Python around the kernels (Gemma 3 270M, batch 1: ~6 of ~18 ms), most of it per layer:
module calls, the checks each wrapper repeats, a bound function looked up by name per
call. `LayerPlan` is built once per layer, after checking once what every call would
check (CPU, bfloat16 or float32, the fused kernels built, per-head norms of one eps, an
activation the kernel has, one rank): its kernel functions and constant arguments bound,
each step runs the layer's ~12 kernel calls in the module path's order on the same inputs,
so it computes the same bytes (tested, bitwise). Linears run their own `forward` (a
GGUF, int8 or packed bfloat16 one); attention runs its impl (the KV write and the
paged-attention kernel, or the torch path for a cache the kernel cannot read).

`Gemma3Model` uses the plans unless `use_native_layers(False)` was called (`pd bench step`
does, to time the parts with module hooks) or a layer's plan cannot be built; per step it
checks only the hidden state (dtype, device, rows).
"""

from __future__ import annotations

import torch
from torch import nn

from pd.forward_context import get_forward_context
from pd.models import fused


class LayerPlan:
    """One Gemma 3 decoder layer (`Gemma3DecoderLayer`) as bound kernel calls for hidden
    states of `dtype`; `build` returns None where the module path must run instead."""

    def __init__(self, layer: nn.Module, dtype: torch.dtype) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        library, suffix = fused._library(), fused._SUFFIX[dtype]
        self.dtype = dtype
        self._rms_norm = getattr(library, f"rms_norm_{suffix}")
        self._qk_norm_rope = getattr(library, f"qk_norm_rope_{suffix}")
        self._act_mul = getattr(library, f"act_mul_{suffix}")
        self.norms = (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                      layer.post_feedforward_layernorm)
        self.qkv, self.o, self.gate_up, self.down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
        self.heads, self.kv_heads, self.head_size = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.q_norm, self.k_norm, self.rope = attn.q_norm, attn.k_norm, attn.rotary_emb
        self.attn = attn.attn
        self.activation = fused.ACTIVATIONS[mlp.act_name]

    @classmethod
    def build(cls, layer: nn.Module, dtype: torch.dtype) -> LayerPlan | None:
        attn, mlp = layer.self_attn, layer.mlp
        fits = (dtype in fused._SUFFIX and fused._library() is not None
                and attn.shard.size == 1 and mlp.shard.size == 1
                and mlp.act_name in fused.ACTIVATIONS
                and attn.q_norm.eps == attn.k_norm.eps
                and attn.rotary_emb.cos.device.type == "cpu" and attn.rotary_emb.cos.dtype == torch.float32
                and all(p.device.type == "cpu" for p in layer.parameters()))
        return cls(layer, dtype) if fits else None

    def __call__(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The layer's output for hidden states x (tokens, hidden) of the plan's dtype,
        contiguous, on CPU, at positions (tokens,) int64 contiguous (the caller checks)."""
        threads = torch.get_num_threads()
        self.rope._check(positions)  # an IndexError as the module path raises (the kernel refuses too)
        q, k, v = self._project(positions, self._norm(x, self.norms[0], None, threads), threads)
        x = self._norm(self.o.forward(self._attend(q, k, v)), self.norms[1], x, threads)
        gate_up = self.gate_up.forward(self._norm(x, self.norms[2], None, threads))
        inter = gate_up.shape[1] // 2
        act = torch.empty(gate_up.shape[0], inter, dtype=self.dtype)
        self._check(self._act_mul(gate_up.data_ptr(), gate_up.stride(0), act.data_ptr(), inter, gate_up.shape[0],
                                  inter, self.activation, threads), "act_mul")
        return self._norm(self.down.forward(act), self.norms[3], x, threads)

    def _norm(self, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None, threads: int) -> torch.Tensor:
        """fused.rms_norm: x normed, plus the residual when given."""
        out = torch.empty(x.shape, dtype=self.dtype)
        self._check(self._rms_norm(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                                   0 if residual is None else residual.stride(0), out.data_ptr(), x.shape[1],
                                   norm.float_weight().data_ptr(), x.shape[0], x.shape[1], norm.eps, threads),
                    "rms_norm")
        return out

    def _project(self, positions: torch.Tensor, x: torch.Tensor, threads: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fused.qk_norm_rope over the fused projection: q and k normed per head and
        rotated, v a view of the projection."""
        qkv = self.qkv.forward(x)
        tokens, size = qkv.shape[0], self.head_size
        q = torch.empty(tokens, self.heads * size, dtype=self.dtype)
        k = torch.empty(tokens, self.kv_heads * size, dtype=self.dtype)
        rope = self.rope
        self._check(self._qk_norm_rope(
            qkv.data_ptr(), qkv.stride(0), tokens, self.heads, self.kv_heads, size,
            self.q_norm.float_weight().data_ptr(), self.k_norm.float_weight().data_ptr(), self.q_norm.eps,
            positions.data_ptr(), rope.cos.data_ptr(), rope.signed_sin.data_ptr(), rope.cos.shape[1],
            rope.cos.shape[0], q.data_ptr(), k.data_ptr(), threads), "qk_norm_rope")
        return q, k, qkv[:, (self.heads + self.kv_heads) * size:]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """`Attention.forward` without the module call: the KV write and attention of this
        layer's cache and metadata."""
        context, name, size = get_forward_context(), self.attn.layer_name, self.head_size
        out = self.attn.impl.forward(q.view(-1, self.heads, size), k.view(-1, self.kv_heads, size),
                                     v.view(-1, self.kv_heads, size), context.kv_caches[name].kv,
                                     context.attn_metadata[name])
        return out.reshape(-1, self.heads * size)

    @staticmethod
    def _check(status: int, name: str) -> None:
        if status:
            raise ValueError(f"native {name} refused its arguments")

