"""Gemma 3, Bamba and Granite-hybrid model files against transformers on random checkpoints.

Each checkpoint comes from `pd make-model`; ours runs one request's whole prompt in one
step over the paged KV cache (a minimal single-request harness, below) and must give
transformers' logits at every position. Prompts are longer than Gemma 3's sliding
window and than the Mamba chunk, so both matter.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pd.kv_cache.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from pd.models.loader import load_model
from pd.models.make_model import make_model
from pd.models.model_config import ModelConfig
from pd.models.registry import model_class
from tests.support.model_runs import BLOCK_SIZE, run_prompt

PROMPT_LEN = 300  # > Gemma 3's window (128) and the Mamba chunk (256): checked below
TOL = 1e-3
ARCHS = ["gemma3", "bamba", "granitehybrid"]


def _make(arch: str, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(arch)
    make_model(arch, out, seed=0)
    return out


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory) -> Path:
    return _make("gemma3", tmp_path_factory)


@pytest.fixture(scope="module")
def bamba_dir(tmp_path_factory) -> Path:
    return _make("bamba", tmp_path_factory)


@pytest.fixture(scope="module")
def granitehybrid_dir(tmp_path_factory) -> Path:
    return _make("granitehybrid", tmp_path_factory)


@pytest.fixture(params=ARCHS)
def checkpoint(request) -> tuple[str, Path]:
    return request.param, request.getfixturevalue(f"{request.param}_dir")


def _prompt(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))


def _max_logit_diff(path: Path, hybrid: bool = True) -> float:
    """Ours against transformers on one random prompt, every position, float32."""
    from transformers import AutoModelForCausalLM

    model = load_model(ModelConfig.from_dir(path, dtype="float32"))
    assert PROMPT_LEN > max(model.config.get("sliding_window", 0), model.config.get("mamba_chunk_size", 0))
    tokens = _prompt(model.config.vocab_size)
    ours = run_prompt(model, tokens, hybrid)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(tokens[None]).logits[0].float()
    assert ours.shape == expected.shape == (PROMPT_LEN, model.config.vocab_size)
    diff = (ours - expected).abs().max().item()
    print(f"{model.config.architectures[0]} (hybrid KV cache: {hybrid}): max abs logit diff {diff:.2e}")
    return diff


def test_full_prompt_logits_match_transformers(checkpoint):
    arch, path = checkpoint
    assert _max_logit_diff(path) <= TOL, arch


# Config variants the make-model checkpoints do not exercise: transformers-5 style RoPE
# parameters keyed by layer type with linear scaling, logit softcapping; Granite with RoPE
# and an attention scale large enough that positions matter.
VARIANTS = {
    "gemma3": {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
               "final_logit_softcapping": 0.5, "query_pre_attn_scalar": 1},
    "granitehybrid": {"position_embedding_type": "rope", "attention_multiplier": 1.0},
}


@pytest.mark.parametrize("arch", sorted(VARIANTS))
def test_config_variants_match_transformers(request, tmp_path, arch):
    path = tmp_path / arch
    shutil.copytree(request.getfixturevalue(f"{arch}_dir"), path)
    config = json.loads((path / "config.json").read_text())
    for key in ("rope_theta", "rope_local_base_freq", "rope_scaling"):
        config.pop(key, None)
    (path / "config.json").write_text(json.dumps(config | VARIANTS[arch]))
    assert _max_logit_diff(path) <= TOL


def test_loads_in_bfloat16_with_finite_logits(checkpoint):
    """bfloat16 weights and KV cache; logits stay near float32's (transformers' own
    bfloat16 runs differ from float32 by ~0.03 on these checkpoints)."""
    _, path = checkpoint
    model = load_model(ModelConfig.from_dir(path, dtype="bfloat16"))
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    for spec in model.kv_cache_specs(BLOCK_SIZE).values():
        dtypes = {spec.conv_dtype, spec.ssm_dtype} if isinstance(spec, MambaSpec) else {spec.dtype}
        assert dtypes == {"bfloat16"}
    tokens = _prompt(model.config.vocab_size)
    logits = run_prompt(model, tokens)
    assert logits.dtype == torch.bfloat16  # the model's dtype: whoever needs float32 widens
    assert torch.isfinite(logits).all()
    reference = run_prompt(load_model(ModelConfig.from_dir(path, dtype="float32")), tokens)
    assert (logits.float() - reference).abs().max().item() < 0.1


def test_gemma3_kv_cache_specs(gemma3_dir):
    model = load_model(ModelConfig.from_dir(gemma3_dir))
    hybrid = model.kv_cache_specs(BLOCK_SIZE)
    assert list(hybrid) == [f"layers.{i}" for i in range(6)]
    kinds = [type(s) for s in hybrid.values()]
    assert kinds.count(SlidingWindowSpec) == 4 and kinds.count(FullAttentionSpec) == 2
    assert {s.sliding_window for s in hybrid.values() if isinstance(s, SlidingWindowSpec)} == {128}
    assert all((s.num_kv_heads, s.head_size, s.dtype) == (2, 64, "float32") for s in hybrid.values())
    non_hybrid = model.kv_cache_specs(BLOCK_SIZE, hybrid=False)
    assert all(type(s) is FullAttentionSpec for s in non_hybrid.values())


def test_gemma3_non_hybrid_kv_cache_still_attends_within_window(gemma3_dir):
    """Non-hybrid mode keeps every token's KV, but sliding layers must still see only
    their window (the prompt is longer than it)."""
    assert _max_logit_diff(gemma3_dir, hybrid=False) <= TOL


@pytest.mark.parametrize("arch", ["bamba", "granitehybrid"])
def test_hybrid_kv_cache_specs(request, arch):
    model = load_model(ModelConfig.from_dir(request.getfixturevalue(f"{arch}_dir")))
    specs = model.kv_cache_specs(BLOCK_SIZE)
    assert list(specs) == [f"layers.{i}" for i in range(len(model.model.layers))]
    mamba = [s for s in specs.values() if isinstance(s, MambaSpec)]
    attention = [s for s in specs.values() if type(s) is FullAttentionSpec]
    assert mamba and attention and len(mamba) + len(attention) == len(specs)
    config = model.config
    heads, head_dim, state = (config.get(k) for k in ("mamba_n_heads", "mamba_d_head", "mamba_d_state"))
    conv_dim = heads * head_dim + 2 * config.get("mamba_n_groups") * state
    assert all(s.conv_state_shape == (conv_dim, config.get("mamba_d_conv") - 1) for s in mamba)
    assert all(s.ssm_state_shape == (heads, head_dim, state) for s in mamba)
    assert all(s.conv_dtype == s.ssm_dtype == "float32" for s in mamba)
    attn_head_dim = config.get("hidden_size") // config.get("num_attention_heads")
    expected = (config.get("num_key_value_heads"), attn_head_dim, "float32")
    assert all((s.num_kv_heads, s.head_size, s.dtype) == expected for s in attention)
    with pytest.raises(ValueError, match="no-hybrid-kv-cache"):
        model.kv_cache_specs(BLOCK_SIZE, hybrid=False)


@pytest.mark.parametrize("arch, edit, match", [
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("granitehybrid", {"num_local_experts": 4}, "num_local_experts=4"),
    ("bamba", {"hidden_act": "gelu"}, "silu"),
])
def test_unsupported_configs_are_refused(request, arch, edit, match):
    config = ModelConfig.from_dir(request.getfixturevalue(f"{arch}_dir"))
    edited = ModelConfig(config.model_dir, config.hf_config | edit)
    with pytest.raises(NotImplementedError, match=match):
        model_class(edited.architectures)(edited)
