"""Llama, Qwen2 and Qwen3: pre-norm decoder layers with GQA attention and a gated MLP.

Qwen2 adds q/k/v biases, Qwen3 a per-head RMSNorm on q and k. A layer attends within a
sliding window when `layer_types` (or Qwen2's `use_sliding_window`/`max_window_layers`)
says so.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pd.attention.layer import Attention
from pd.models.base import CausalLM
from pd.models.layers import GatedMLP, RMSNorm, attention_projections, get_rope, rope_parameters
from pd.models.model_config import ModelConfig
from pd.models.parallel import ParallelLMHead, VocabParallelEmbedding, tp_reduce


def layer_types(config: ModelConfig) -> list[str]:
    """"full_attention" / "sliding_attention" per layer, in any published form."""
    n = config.get("num_hidden_layers")
    types = config.get("layer_types")
    if types:
        return list(types)
    window = config.get("sliding_window") if config.get("use_sliding_window", False) else None
    first = config.get("max_window_layers", n)
    return ["sliding_attention" if window and i >= first else "full_attention" for i in range(n)]


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, index: int, sliding_window: int | None,
                 rope: dict[str, Any], qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        hidden = config.get("hidden_size")
        num_heads = config.get("num_attention_heads")
        self.head_dim = config.get("head_dim", hidden // num_heads)
        self.shard = config.tp
        self.qkv_proj, self.o_proj, self.num_heads, self.num_kv_heads = attention_projections(
            hidden, num_heads, config.get("num_key_value_heads", num_heads), self.head_dim, self.shard,
            qkv_bias, o_bias)
        eps = config.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        max_positions = max(config.context_len, config.get("max_position_embeddings", 0))
        self.rotary_emb = get_rope(self.head_dim, max_positions, rope)
        self.attn = Attention(f"layers.{index}", self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=self.head_dim**-0.5, sliding_window=sliding_window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.rotary_emb.norm_rotate(positions, self.qkv_proj(x), self.num_heads, self.num_kv_heads,
                                              self.q_norm, self.k_norm)
        return tp_reduce(self.o_proj(self.attn(q, k, v)), self.shard)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, self_attn: LlamaAttention) -> None:
        super().__init__()
        hidden, eps = config.get("hidden_size"), config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, config.get("intermediate_size"), config.get("hidden_act", "silu"),
                            bias=config.get("mlp_bias", False), shard=config.tp)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, family: str) -> None:
        super().__init__()
        hidden = config.get("hidden_size")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, config.tp)
        bias = config.get("attention_bias", False)
        qkv_bias = True if family == "qwen2" else bias
        rope = rope_parameters(config.hf_config)
        window = config.get("sliding_window")
        self.layers = nn.ModuleList()
        for i, kind in enumerate(layer_types(config)):
            sliding = window if kind == "sliding_attention" else None
            attn = LlamaAttention(config, i, sliding, rope, qkv_bias, bias and family != "qwen2",
                                  qk_norm=family == "qwen3")
            self.layers.append(LlamaDecoderLayer(config, i, attn))
        self.norm = RMSNorm(hidden, config.get("rms_norm_eps", 1e-6))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)


class LlamaForCausalLM(CausalLM):
    family = "llama"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.model = LlamaModel(config, self.family)
        self.lm_head = ParallelLMHead(config.get("hidden_size"), config.vocab_size, config.tp)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def kv_cache_layers(self) -> dict[str, nn.Module]:
        return {layer.self_attn.attn.layer_name: layer.self_attn.attn for layer in self.model.layers}


class Qwen2ForCausalLM(LlamaForCausalLM):
    family = "qwen2"


class Qwen3ForCausalLM(LlamaForCausalLM):
    family = "qwen3"
