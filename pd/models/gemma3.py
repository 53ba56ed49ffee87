"""Gemma 3 (text): sandwich-normed decoder layers, local/global attention, scaled embeddings.

Numerics follow transformers' `Gemma3ForCausalLM`: embeddings are multiplied by
sqrt(hidden_size) cast to the weights' dtype (so in bfloat16 the scale is rounded); all
norms are Gemma RMSNorms (weight stored as a delta from 1), including a per-head norm on
q and k; attention scale is `query_pre_attn_scalar**-0.5`; sliding layers use the local
RoPE base and global layers the global one (with its scaling, e.g. linear).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pd.attention.layer import Attention
from pd.models import fused
from pd.models.base import CausalLM
from pd.models.layers import GatedMLP, RMSNorm, attention_projections, get_rope
from pd.models.model_config import ModelConfig
from pd.models.native_decoder import NativeDecoder
from pd.models.native_layers import LayerPlan
from pd.models.parallel import ParallelLMHead, VocabParallelEmbedding, tp_reduce

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' Gemma3TextConfig defaults, for configs that leave a field out.
DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}
DEFAULT_SLIDING_WINDOW_PATTERN = 6


def gemma3_layer_types(config: ModelConfig) -> list[str]:
    """Per layer, sliding or full attention: `layer_types`, else every
    `sliding_window_pattern`-th layer is full (the rest sliding)."""
    types = config.get("layer_types")
    if types:
        return list(types)
    pattern = config.get("sliding_window_pattern", DEFAULT_SLIDING_WINDOW_PATTERN)
    return [SLIDING if (i + 1) % pattern else FULL for i in range(config.get("num_hidden_layers"))]


def gemma3_rope(hf_config: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """RoPE parameters of one layer type. transformers-5 configs key `rope_parameters` by
    layer type; older ones give `rope_theta` (global), `rope_local_base_freq` (local) and a
    `rope_scaling` that applies to global layers only."""
    params = hf_config.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:
        out = dict(params[layer_type] or {})
    elif layer_type == FULL:
        out = dict(hf_config.get("rope_scaling") or {})
    else:
        out = {}
    legacy_theta = hf_config.get("rope_theta" if layer_type == FULL else "rope_local_base_freq")
    out.setdefault("rope_theta", legacy_theta or DEFAULT_THETA[layer_type])
    out["rope_type"] = out.get("rope_type", out.get("type", "default"))
    return out


class Gemma3Attention(nn.Module):
    def __init__(self, config: ModelConfig, index: int, layer_type: str) -> None:
        super().__init__()
        hidden = config.get("hidden_size")
        num_heads = config.get("num_attention_heads")
        self.head_dim = config.get("head_dim", 256)
        bias = config.get("attention_bias", False)
        self.shard = config.tp
        self.qkv_proj, self.o_proj, self.num_heads, self.num_kv_heads = attention_projections(
            hidden, num_heads, config.get("num_key_value_heads", num_heads), self.head_dim, self.shard, bias, bias)
        eps = config.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps, offset=1.0)
        self.k_norm = RMSNorm(self.head_dim, eps, offset=1.0)
        max_position = max(config.context_len, config.get("max_position_embeddings", 0))
        self.rotary_emb = get_rope(self.head_dim, max_position, gemma3_rope(config.hf_config, layer_type))
        window = config.get("sliding_window", 4096) if layer_type == SLIDING else None
        scale = config.get("query_pre_attn_scalar", 256) ** -0.5
        self.attn = Attention(f"layers.{index}", self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=scale, sliding_window=window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.rotary_emb.norm_rotate(positions, self.qkv_proj(x), self.num_heads, self.num_kv_heads,
                                              self.q_norm, self.k_norm)
        return tp_reduce(self.o_proj(self.attn(q, k, v)), self.shard)


class Gemma3DecoderLayer(nn.Module):
    """Each sub-block's output is normed before it joins the residual stream."""

    def __init__(self, config: ModelConfig, index: int, layer_type: str) -> None:
        super().__init__()
        hidden, eps = config.get("hidden_size"), config.get("rms_norm_eps", 1e-6)
        self.self_attn = Gemma3Attention(config, index, layer_type)
        self.mlp = GatedMLP(hidden, config.get("intermediate_size"),
                            config.get("hidden_activation", "gelu_pytorch_tanh"), shard=config.tp)
        self.input_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset=1.0)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x)), residual=x)
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)), residual=x)


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.get("hidden_size")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, config.tp)
        self.embed_scale = hidden**0.5
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i, kind)
                                    for i, kind in enumerate(gemma3_layer_types(config)))
        self.norm = RMSNorm(hidden, config.get("rms_norm_eps", 1e-6), offset=1.0)
        self.native_layers = True
        self.native_decoder = True
        self._plans: dict[torch.dtype, list[LayerPlan] | None] = {}
        self._decoders: dict[torch.dtype, NativeDecoder | None] = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # The scale is cast to the weights' dtype first, as transformers does.
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)
        plans = self._layer_plans(x, positions)
        if plans is None:
            for layer in self.layers:
                x = layer(positions, x)
        else:
            positions = positions.to(torch.int64).contiguous()
            decoder = self._decoder(x.dtype, plans)
            out = None if decoder is None else decoder(positions, x)
            if out is None:
                for plan in plans:
                    x = plan(positions, x)
            else:
                x = out
        return self.norm(x)

    def use_native_layers(self, on: bool) -> None:
        """Run the layers as native plans where they can be built (the default), or as
        modules (whose hooks then fire)."""
        self.native_layers = on

    def use_native_decoder(self, on: bool) -> None:
        """Run the plans' layers all in one native call a step where it can be built (the
        default), or plan by plan (whose linears' `forward` then runs)."""
        self.native_decoder = on

    def _decoder(self, dtype: torch.dtype, plans: list[LayerPlan]) -> NativeDecoder | None:
        if not self.native_decoder:
            return None
        if dtype not in self._decoders:
            self._decoders[dtype] = NativeDecoder.build(plans, dtype)
        return self._decoders[dtype]

    def _layer_plans(self, x: torch.Tensor, positions: torch.Tensor) -> list[LayerPlan] | None:
        """The layers' plans for these hidden states, or None: the module path (also where
        the modules would not take the fused kernels)."""
        if (not self.native_layers or x.dim() != 2 or positions.dim() != 1 or not x.is_contiguous()
                or not fused.supports(x)):
            return None
        if x.dtype not in self._plans:
            plans = [LayerPlan.build(layer, x.dtype) for layer in self.layers]
            self._plans[x.dtype] = plans if all(plans) else None
        return self._plans[x.dtype]


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        _check_supported(config)
        self.model = Gemma3Model(config)
        self.lm_head = ParallelLMHead(config.get("hidden_size"), config.vocab_size, config.tp)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_logit_softcapping = config.get("final_logit_softcapping")

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", True))  # Gemma's default

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.logits(hidden)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def kv_cache_layers(self) -> dict[str, nn.Module]:
        return {layer.self_attn.attn.layer_name: layer.self_attn.attn for layer in self.model.layers}


def _check_supported(config: ModelConfig) -> None:
    if config.get("attn_logit_softcapping") is not None:
        raise NotImplementedError("Gemma 3 with attn_logit_softcapping is not supported: "
                                  "the attention backends have no logit softcapping")
    if config.get("use_bidirectional_attention", False):
        raise NotImplementedError("Gemma 3 with use_bidirectional_attention is not supported "
                                  "(a causal LM server needs causal attention)")
