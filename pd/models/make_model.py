"""`pd make-model`: tiny random checkpoints in the format each family publishes on the HF hub.

A checkpoint is config.json, model.safetensors (float32, published tensor names and
shapes), generation_config.json and the tokenizer files of `tiny_tokenizer`. Everything
is a pure function of (arch, seed): two runs write byte-identical files. transformers is
not needed here; it is only the tests' reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pd.models.tiny_tokenizer import FAMILIES, TokenIds, write_json, write_tokenizer_files

VOCAB = 4096
HIDDEN = 256
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
INTERMEDIATE = 512
MAX_POSITIONS = 4096
MAMBA_HEADS, MAMBA_HEAD_DIM, MAMBA_STATE, MAMBA_GROUPS, MAMBA_CONV = 8, 64, 64, 1, 4
MAMBA_INNER = MAMBA_HEADS * MAMBA_HEAD_DIM  # = mamba_expand (2) * HIDDEN
MAMBA_CONV_DIM = MAMBA_INNER + 2 * MAMBA_GROUPS * MAMBA_STATE
STD = 0.02

# A weight spec: (name, shape, init). Inits are the keys of _INITS.
WeightSpec = tuple[str, tuple[int, ...], str]


def _inverse_softplus_dt(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Mamba2's dt_bias init: softplus(dt_bias) = dt, dt log-uniform in [1e-3, 0.1]."""
    low, high = math.log(1e-3), math.log(0.1)
    dt = torch.exp(torch.rand(shape, generator=gen) * (high - low) + low)
    return dt + torch.log(-torch.expm1(-dt))


_INITS: dict[str, Callable[[tuple[int, ...], torch.Generator], torch.Tensor]] = {
    "normal": lambda shape, gen: torch.randn(shape, generator=gen) * STD,
    # RMSNorm weights multiply: around 1, noisy enough that a wrong norm shows in tests.
    "norm": lambda shape, gen: 1.0 + 0.1 * torch.randn(shape, generator=gen),
    # Gemma RMSNorm weights are offsets used as (1 + weight).
    "offset_norm": lambda shape, gen: 0.1 * torch.randn(shape, generator=gen),
    # Depthwise conv, kaiming-uniform-like (fan_in = d_conv) so the conv path matters.
    "conv": lambda shape, gen: (torch.rand(shape, generator=gen) * 2 - 1) / math.sqrt(MAMBA_CONV),
    "A_log": lambda shape, gen: torch.log(1 + 15 * torch.rand(shape, generator=gen)),
    "D": lambda shape, gen: 1.0 + 0.1 * torch.randn(shape, generator=gen),
    "dt_bias": _inverse_softplus_dt,
}


def _linear(name: str, out_features: int, in_features: int) -> WeightSpec:
    return (f"{name}.weight", (out_features, in_features), "normal")


def _norm(name: str, size: int = HIDDEN, init: str = "norm") -> WeightSpec:
    return (f"{name}.weight", (size,), init)


def _attention(prefix: str, qk_norm_init: str | None) -> list[WeightSpec]:
    """q/k/v/o projections; q_norm/k_norm over head_dim when the family has them."""
    specs = [
        _linear(f"{prefix}.q_proj", HEADS * HEAD_DIM, HIDDEN),
        _linear(f"{prefix}.k_proj", KV_HEADS * HEAD_DIM, HIDDEN),
        _linear(f"{prefix}.v_proj", KV_HEADS * HEAD_DIM, HIDDEN),
        _linear(f"{prefix}.o_proj", HIDDEN, HEADS * HEAD_DIM),
    ]
    if qk_norm_init is not None:
        specs += [_norm(f"{prefix}.q_norm", HEAD_DIM, qk_norm_init),
                  _norm(f"{prefix}.k_norm", HEAD_DIM, qk_norm_init)]
    return specs


def _gated_mlp(prefix: str) -> list[WeightSpec]:
    return [_linear(f"{prefix}.gate_proj", INTERMEDIATE, HIDDEN),
            _linear(f"{prefix}.up_proj", INTERMEDIATE, HIDDEN),
            _linear(f"{prefix}.down_proj", HIDDEN, INTERMEDIATE)]


def _mamba2(prefix: str) -> list[WeightSpec]:
    """Mamba2 mixer: in_proj packs [z, x, B, C, dt]; conv1d is depthwise over [x, B, C]."""
    in_proj = 2 * MAMBA_INNER + 2 * MAMBA_GROUPS * MAMBA_STATE + MAMBA_HEADS
    return [
        _linear(f"{prefix}.in_proj", in_proj, HIDDEN),
        (f"{prefix}.conv1d.weight", (MAMBA_CONV_DIM, 1, MAMBA_CONV), "conv"),
        (f"{prefix}.conv1d.bias", (MAMBA_CONV_DIM,), "conv"),
        (f"{prefix}.dt_bias", (MAMBA_HEADS,), "dt_bias"),
        (f"{prefix}.A_log", (MAMBA_HEADS,), "A_log"),
        (f"{prefix}.D", (MAMBA_HEADS,), "D"),
        _norm(f"{prefix}.norm", MAMBA_INNER),
        _linear(f"{prefix}.out_proj", HIDDEN, MAMBA_INNER),
    ]


def _qwen3_weights(layer_types: list[str]) -> list[WeightSpec]:
    specs = [_linear("model.embed_tokens", VOCAB, HIDDEN)]
    for i in range(len(layer_types)):
        p = f"model.layers.{i}"
        specs += _attention(f"{p}.self_attn", "norm") + _gated_mlp(f"{p}.mlp")
        specs += [_norm(f"{p}.input_layernorm"), _norm(f"{p}.post_attention_layernorm")]
    return specs + [_norm("model.norm")]


def _gemma3_weights(layer_types: list[str]) -> list[WeightSpec]:
    specs = [_linear("model.embed_tokens", VOCAB, HIDDEN)]
    for i in range(len(layer_types)):
        p = f"model.layers.{i}"
        specs += _attention(f"{p}.self_attn", "offset_norm") + _gated_mlp(f"{p}.mlp")
        specs += [_norm(f"{p}.{name}", init="offset_norm") for name in (
            "input_layernorm", "post_attention_layernorm",
            "pre_feedforward_layernorm", "post_feedforward_layernorm")]
    return specs + [_norm("model.norm", init="offset_norm")]


def _bamba_weights(layer_types: list[str]) -> list[WeightSpec]:
    specs = [_linear("model.embed_tokens", VOCAB, HIDDEN)]
    for i, kind in enumerate(layer_types):
        p = f"model.layers.{i}"
        mixer = _mamba2(f"{p}.mamba") if kind == "mamba" else _attention(f"{p}.self_attn", None)
        specs += mixer + _gated_mlp(f"{p}.feed_forward")
        specs += [_norm(f"{p}.input_layernorm"), _norm(f"{p}.pre_ff_layernorm")]
    return specs + [_norm("model.final_layernorm"), _linear("lm_head", VOCAB, HIDDEN)]


def _granite_weights(layer_types: list[str]) -> list[WeightSpec]:
    specs = [_linear("model.embed_tokens", VOCAB, HIDDEN)]
    for i, kind in enumerate(layer_types):
        p = f"model.layers.{i}"
        mixer = _mamba2(f"{p}.mamba") if kind == "mamba" else _attention(f"{p}.self_attn", None)
        specs += mixer + [_linear(f"{p}.shared_mlp.input_linear", 2 * INTERMEDIATE, HIDDEN),
                          _linear(f"{p}.shared_mlp.output_linear", HIDDEN, INTERMEDIATE)]
        specs += [_norm(f"{p}.input_layernorm"), _norm(f"{p}.post_attention_layernorm")]
    return specs + [_norm("model.norm")]


def _attention_dims() -> dict[str, Any]:
    return {"hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "attention_bias": False, "attention_dropout": 0.0, "initializer_range": STD,
            "max_position_embeddings": MAX_POSITIONS, "vocab_size": VOCAB,
            "torch_dtype": "float32", "use_cache": True}


def _mamba_dims() -> dict[str, Any]:
    return {"mamba_n_heads": MAMBA_HEADS, "mamba_d_head": MAMBA_HEAD_DIM,
            "mamba_d_state": MAMBA_STATE, "mamba_n_groups": MAMBA_GROUPS,
            "mamba_d_conv": MAMBA_CONV, "mamba_expand": MAMBA_INNER // HIDDEN,
            "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_proj_bias": False}


def _qwen3_config(layer_types: list[str], ids: TokenIds) -> dict[str, Any]:
    """As Qwen3-0.6B: tied embeddings, q/k norms, `bos_token_id` is <|endoftext|>."""
    return _attention_dims() | {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "bos_token_id": ids.pad, "eos_token_id": ids.eos,
        "head_dim": HEAD_DIM, "hidden_act": "silu", "layer_types": layer_types,
        "max_window_layers": len(layer_types), "num_hidden_layers": len(layer_types),
        "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1_000_000.0,
        "sliding_window": None, "tie_word_embeddings": True, "use_sliding_window": False,
    }


def _gemma3_config(layer_types: list[str], ids: TokenIds) -> dict[str, Any]:
    """As gemma-3-1b-it: local/global attention, two RoPE bases, (1 + w) norms."""
    return _attention_dims() | {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "attn_logit_softcapping": None, "bos_token_id": ids.bos, "eos_token_id": list(ids.stops),
        "final_logit_softcapping": None, "head_dim": HEAD_DIM,
        "hidden_activation": "gelu_pytorch_tanh", "layer_types": layer_types,
        "num_hidden_layers": len(layer_types), "pad_token_id": ids.pad,
        "query_pre_attn_scalar": HEAD_DIM, "rms_norm_eps": 1e-6,
        "rope_local_base_freq": 10_000.0, "rope_scaling": None, "rope_theta": 1_000_000.0,
        "sliding_window": 128, "sliding_window_pattern": 3, "tie_word_embeddings": True,
    }


def _bamba_config(layer_types: list[str], ids: TokenIds) -> dict[str, Any]:
    """As Bamba-9B: attention layers by index, RoPE over half of each head (attn_rotary_emb)."""
    return _attention_dims() | _mamba_dims() | {
        "architectures": ["BambaForCausalLM"], "model_type": "bamba",
        "attn_layer_indices": [i for i, kind in enumerate(layer_types) if kind == "attention"],
        "attn_rotary_emb": HEAD_DIM // 2, "bos_token_id": ids.bos, "eos_token_id": ids.eos,
        "hidden_act": "silu", "num_hidden_layers": len(layer_types), "num_logits_to_keep": 1,
        "pad_token_id": ids.pad, "rms_norm_eps": 1e-5, "rope_theta": 10_000.0,
        "tie_word_embeddings": False,
    }


def _granite_config(layer_types: list[str], ids: TokenIds) -> dict[str, Any]:
    """As granite-4.0-h-micro: dense (no experts), no positional embedding, muP multipliers."""
    return _attention_dims() | _mamba_dims() | {
        "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
        "attention_multiplier": 1.0 / HEAD_DIM, "bos_token_id": ids.bos,
        "embedding_multiplier": 12.0, "eos_token_id": ids.eos, "hidden_act": "silu",
        "layer_types": layer_types, "logits_scaling": 8.0, "normalization_function": "rmsnorm",
        "num_experts_per_tok": 0, "num_hidden_layers": len(layer_types), "num_local_experts": 0,
        "output_router_logits": False, "pad_token_id": ids.pad, "position_embedding_type": "nope",
        "residual_multiplier": 0.22, "rms_norm_eps": 1e-5, "rope_scaling": None,
        "rope_theta": 10_000.0, "router_aux_loss_coef": 0.01,
        "shared_intermediate_size": INTERMEDIATE, "tie_word_embeddings": True,
    }


@dataclass(frozen=True)
class ArchSpec:
    """One architecture: its layer kinds, and how to list its weights and write its config."""

    layer_types: tuple[str, ...]
    weights: Callable[[list[str]], list[WeightSpec]]
    config: Callable[[list[str], TokenIds], dict[str, Any]]


_HYBRID = ("mamba", "mamba", "attention") * 2
ARCHS: dict[str, ArchSpec] = {
    "qwen3": ArchSpec(("full_attention",) * 4, _qwen3_weights, _qwen3_config),
    "gemma3": ArchSpec(("sliding_attention", "sliding_attention", "full_attention") * 2,
                       _gemma3_weights, _gemma3_config),
    "bamba": ArchSpec(_HYBRID, _bamba_weights, _bamba_config),
    "granitehybrid": ArchSpec(_HYBRID, _granite_weights, _granite_config),
}


def random_weights(specs: list[WeightSpec], seed: int) -> dict[str, torch.Tensor]:
    """Draw every tensor, in spec order, from one generator seeded with `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return {name: _INITS[init](shape, gen).to(torch.float32).contiguous()
            for name, shape, init in specs}


def make_model(arch: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny random `arch` checkpoint into `out_dir` (created if needed); return it.

    The same (arch, seed) always gives byte-identical files; the tokenizer depends only on
    `arch`, the weights also on `seed`.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    spec, out = ARCHS[arch], Path(out_dir)
    layer_types = list(spec.layer_types)
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer_files(FAMILIES[arch], out, VOCAB, MAX_POSITIONS)
    config = spec.config(layer_types, ids)
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", _generation_config(config, ids))
    # Fixed metadata only, so the file's bytes depend on nothing but the tensors.
    save_file(random_weights(spec.weights(layer_types), seed), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def _generation_config(config: dict[str, Any], ids: TokenIds) -> dict[str, Any]:
    """bos as config.json names it; every stop token as eos (a list when there are several)."""
    stops = list(ids.stops)
    return {"bos_token_id": config["bos_token_id"], "pad_token_id": ids.pad,
            "eos_token_id": stops[0] if len(stops) == 1 else stops}
