"""Bamba and Granite 4.0 hybrid (dense): Mamba2 layers interleaved with attention layers.

Both are pre-norm decoders whose layers hold either a Mamba2 mixer or GQA attention,
followed by a gated MLP. They differ in naming and in a few knobs, gathered in
`HybridArch`:

- Bamba: `attn_layer_indices` picks the attention layers; attention scale
  head_dim**-0.5; RoPE always, over the first `partial_rotary_factor` (0.5, which
  transformers hard-codes when the config does not say otherwise) of each head.
- GraniteMoeHybrid: `layer_types` ("mamba"/"attention" or the transformers-5 names);
  RoPE only when `position_embedding_type == "rope"` (otherwise no positional encoding
  at all); `attention_multiplier` is the attention scale; embeddings are multiplied by
  `embedding_multiplier`, every residual branch by `residual_multiplier`, and the logits
  divided by `logits_scaling`. Only the dense form (`num_local_experts == 0`) is served.

Internally both use one set of module names (`mlp`, `post_attention_layernorm`, `norm`);
`map_weight_name` renames the published ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pd.attention.layer import Attention
from pd.kv_cache.spec import KVCacheSpec
from pd.models.base import CausalLM
from pd.models.layers import GatedMLP, RMSNorm, attention_projections, get_rope, rope_parameters
from pd.models.mamba2 import Mamba2Mixer
from pd.models.model_config import ModelConfig
from pd.models.parallel import ParallelLMHead, VocabParallelEmbedding, tp_reduce

MAMBA, ATTENTION = "mamba", "attention"
_KIND_NAMES = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION}


@dataclass(frozen=True)
class HybridArch:
    """What differs between the hybrid families, read from the config once."""

    layer_kinds: tuple[str, ...]  # MAMBA or ATTENTION per layer
    mlp_size: int
    attention_scale: float
    rope: dict[str, Any] | None  # None: attention layers have no positional encoding
    rotary_dim: int
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0


def attention_head_dim(config: ModelConfig) -> int:
    return config.get("head_dim", config.get("hidden_size") // config.get("num_attention_heads"))


class HybridAttention(nn.Module):
    def __init__(self, config: ModelConfig, arch: HybridArch, index: int) -> None:
        super().__init__()
        hidden = config.get("hidden_size")
        num_heads = config.get("num_attention_heads")
        self.head_dim = attention_head_dim(config)
        bias = config.get("attention_bias", False)
        self.shard = config.tp
        self.qkv_proj, self.o_proj, self.num_heads, self.num_kv_heads = attention_projections(
            hidden, num_heads, config.get("num_key_value_heads", num_heads), self.head_dim, self.shard, bias, bias)
        self.rotary_emb = None
        if arch.rope is not None:
            max_position = max(config.context_len, config.get("max_position_embeddings", 0))
            self.rotary_emb = get_rope(self.head_dim, max_position, arch.rope, arch.rotary_dim)
        self.attn = Attention(f"layers.{index}", self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=arch.attention_scale)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.rotary_emb is None:
            q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        else:
            q, k, v = self.rotary_emb.norm_rotate(positions, self.qkv_proj(x), self.num_heads, self.num_kv_heads)
        return tp_reduce(self.o_proj(self.attn(q, k, v)), self.shard)


def make_mixer(config: ModelConfig, index: int) -> Mamba2Mixer:
    hidden = config.get("hidden_size")
    n_heads = config.get("mamba_n_heads", 128)
    head_dim = config.get("mamba_d_head", "auto")
    if head_dim == "auto":
        head_dim = config.get("mamba_expand", 2) * hidden // n_heads
    return Mamba2Mixer(
        f"layers.{index}", hidden, n_heads, head_dim,
        d_state=config.get("mamba_d_state", 256), n_groups=config.get("mamba_n_groups", 1),
        d_conv=config.get("mamba_d_conv", 4), chunk_size=config.get("mamba_chunk_size", 256),
        conv_bias=config.get("mamba_conv_bias", True), proj_bias=config.get("mamba_proj_bias", False),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        time_step_limit=tuple(float(v) for v in config.get("time_step_limit", (0.0, math.inf))),
        shard=config.tp,
    )


class HybridDecoderLayer(nn.Module):
    """x += m * mixer(norm(x)); x += m * mlp(norm(x)), the mixer Mamba2 or attention."""

    def __init__(self, config: ModelConfig, arch: HybridArch, index: int) -> None:
        super().__init__()
        hidden, eps = config.get("hidden_size"), config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.kind = arch.layer_kinds[index]
        if self.kind == MAMBA:
            self.mamba = make_mixer(config, index)
        else:
            self.self_attn = HybridAttention(config, arch, index)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, arch.mlp_size, config.get("hidden_act", "silu"),
                            bias=config.get("mlp_bias", False), shard=config.tp)
        self.residual_multiplier = arch.residual_multiplier

    @property
    def state_layer(self) -> nn.Module:
        """The module owning this layer's KV cache: the Mamba mixer or the attention."""
        return self.mamba if self.kind == MAMBA else self.self_attn.attn

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.mamba(h) if self.kind == MAMBA else self.self_attn(positions, h)
        x = x + h * self.residual_multiplier
        return x + self.mlp(self.post_attention_layernorm(x)) * self.residual_multiplier


class HybridModel(nn.Module):
    def __init__(self, config: ModelConfig, arch: HybridArch) -> None:
        super().__init__()
        hidden = config.get("hidden_size")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, config.tp)
        self.embedding_multiplier = arch.embedding_multiplier
        self.layers = nn.ModuleList(HybridDecoderLayer(config, arch, i) for i in range(len(arch.layer_kinds)))
        self.norm = RMSNorm(hidden, config.get("rms_norm_eps", 1e-6))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * self.embedding_multiplier
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)


class HybridForCausalLM(CausalLM):
    """The shared model; subclasses say how to read their config (`arch`) and rename
    their published weights (`weight_renames`)."""

    weight_renames: tuple[tuple[str, str], ...] = ()

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        if config.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"{type(self).__name__} with hidden_act={config.get('hidden_act')!r} "
                                      f"is not supported: the Mamba2 mixer applies silu")
        self.arch = self.read_arch(config)
        self.model = HybridModel(config, self.arch)
        self.lm_head = ParallelLMHead(config.get("hidden_size"), config.vocab_size, config.tp)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def read_arch(cls, config: ModelConfig) -> HybridArch:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden) / self.arch.logits_scaling

    def kv_cache_layers(self) -> dict[str, nn.Module]:
        return {f"layers.{i}": layer.state_layer for i, layer in enumerate(self.model.layers)}

    def kv_cache_specs(self, block_size: int, hybrid: bool = True) -> dict[str, KVCacheSpec]:
        """Attention layers' specs (in the KV dtype) and Mamba layers' state specs (always
        in the model dtype: a state is carried forward, and rounding it to 8 bits would
        compound over every token). The non-hybrid mode is refused: it exists for
        attention-only models."""
        if not hybrid and MAMBA in self.arch.layer_kinds:
            raise ValueError(f"the non-hybrid KV cache mode (--no-hybrid-kv-cache) is for attention-only "
                             f"models; {type(self).__name__} has Mamba layers")
        dtype = self.config.dtype
        specs: dict[str, KVCacheSpec] = {}
        for name, layer in self.kv_cache_layers().items():
            if isinstance(layer, Attention):
                specs[name] = layer.kv_cache_spec(block_size, self.config.attention_kv_dtype, hybrid=hybrid)
            else:
                specs[name] = layer.kv_cache_spec(block_size, conv_dtype=dtype, ssm_dtype=dtype)
        return specs

    def map_weight_name(self, name: str) -> str | None:
        for published, ours in self.weight_renames:
            name = name.replace(published, ours)
        return super().map_weight_name(name)


class BambaForCausalLM(HybridForCausalLM):
    weight_renames = ((".feed_forward.", ".mlp."), (".pre_ff_layernorm.", ".post_attention_layernorm."),
                      ("model.final_layernorm.", "model.norm."))

    @classmethod
    def read_arch(cls, config: ModelConfig) -> HybridArch:
        attention = set(config.get("attn_layer_indices", []))
        kinds = tuple(ATTENTION if i in attention else MAMBA for i in range(config.get("num_hidden_layers")))
        head_dim = attention_head_dim(config)
        rope = rope_parameters(config.hf_config)
        # transformers' BambaConfig forces partial_rotary_factor=0.5 unless rope_parameters has
        # one; the published `attn_rotary_emb` (head_dim / 2 in Bamba-9B) is ignored, as there.
        rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 0.5))
        return HybridArch(layer_kinds=kinds, mlp_size=config.get("intermediate_size"),
                          attention_scale=head_dim**-0.5, rope=rope, rotary_dim=rotary_dim)


class GraniteMoeHybridForCausalLM(HybridForCausalLM):
    weight_renames = ((".shared_mlp.input_linear.", ".mlp.gate_up_proj."),
                      (".shared_mlp.output_linear.", ".mlp.down_proj."))

    @classmethod
    def read_arch(cls, config: ModelConfig) -> HybridArch:
        experts = config.get("num_local_experts", 8)  # transformers' default
        if experts > 0:
            raise NotImplementedError(f"GraniteMoeHybrid with num_local_experts={experts} (MoE) is not "
                                      f"supported; only the dense form (num_local_experts=0) is")
        n = config.get("num_hidden_layers")
        names = config.get("layer_types") or config.get("layers_block_type") or ["mamba"] * n
        unknown = sorted(set(names) - set(_KIND_NAMES))
        if unknown:
            raise ValueError(f"unknown GraniteMoeHybrid layer types {unknown}; known: {sorted(_KIND_NAMES)}")
        use_rope = config.get("position_embedding_type") == "rope"
        return HybridArch(
            layer_kinds=tuple(_KIND_NAMES[name] for name in names),
            mlp_size=config.get("shared_intermediate_size", 1024),
            attention_scale=float(config.get("attention_multiplier", 1.0)),
            rope=rope_parameters(config.hf_config) if use_rope else None,
            rotary_dim=attention_head_dim(config),
            embedding_multiplier=float(config.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(config.get("residual_multiplier", 1.0)),
            logits_scaling=float(config.get("logits_scaling", 1.0)),
        )
