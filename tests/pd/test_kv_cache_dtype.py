"""`--kv-cache-dtype fp8_e4m3|int8`: every family serves from an 8-bit attention cache
(Mamba states stay in the model's dtype), the native kernel and the torch path alike, close
to a cache in the model's dtype; the blocks' bytes and the compatibility hash follow the
dtype."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pd.attention import cpu_kernels
from pd.config import EngineConfig
from pd.contracts.sampling_params import SamplingParams
from pd.engine.core import EngineCore
from pd.kv_cache.spec import FullAttentionSpec, MambaSpec
from pd.llm import LLM
from pd.models.make_model import make_model
from pd.worker.rank_setup import connector_context, whole_kv_cache_config

PROMPTS = [list(range(5, 75)), list(range(100, 140))]


@pytest.fixture(scope="module", params=["qwen3", "gemma3", "bamba"])
def model(request, tmp_path_factory):
    return make_model(request.param, tmp_path_factory.mktemp(request.param) / "m", seed=1)


def scored(model, kv_cache_dtype: str) -> list[torch.Tensor]:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    with LLM(str(model), dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, max_model_len=256) as llm:
        return [torch.tensor(r.prompt_logprobs.logprobs)[:, 0] for r in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("kv_dtype, bound", [("fp8_e4m3", 0.2), ("int8", 0.06)])
@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_an_8_bit_cache_scores_prompts_close_to_the_model_dtype(model, kernels, kv_dtype, bound, monkeypatch) -> None:
    """fp8: up to ~6 % rounding per K/V element (measured <= 0.05 here); int8 with a scale
    per row: half a level of the row's largest (measured <= 0.016)."""
    if kernels == "torch":
        monkeypatch.setattr(cpu_kernels, "_library", lambda: None)
    ours, reference = scored(model, kv_dtype), scored(model, "auto")
    for a, b in zip(ours, reference):
        assert a.isfinite().all()
        assert (a - b).abs().max() <= bound
        assert not torch.equal(a, b)  # the cache really is 8-bit


def test_the_attention_pages_are_8_bit_and_the_states_are_not(model) -> None:
    specs = {c: whole_kv_cache_config(EngineConfig.from_flat(model=model, dtype="bfloat16", kv_cache_dtype=c).resolve())
             for c in ("auto", "fp8_e4m3", "int8")}
    for auto, scaled in zip(specs["auto"].groups, specs["int8"].groups):
        if isinstance(auto.spec, FullAttentionSpec):  # int8 rows end in their float32 scale
            assert scaled.spec.dtype == "int8" and scaled.spec.row_bytes == auto.spec.head_size + 4
    for auto, fp8 in zip(specs["auto"].groups, specs["fp8_e4m3"].groups):
        # a hybrid's block grows until an attention page holds a Mamba state: twice the tokens at 8 bits
        if isinstance(auto.spec, FullAttentionSpec):
            assert (auto.spec.dtype, fp8.spec.dtype) == ("bfloat16", "float8_e4m3fn")
            assert fp8.spec.bytes_per_token * 2 == auto.spec.bytes_per_token
        else:
            assert isinstance(fp8.spec, MambaSpec)
            assert replace(fp8.spec, block_size=auto.spec.block_size, page_size_padded=None) == \
                replace(auto.spec, page_size_padded=None)


def test_the_compatibility_hash_follows_the_kv_dtype(model) -> None:
    hashes = {c: connector_context(EngineConfig.from_flat(model=model, kv_cache_dtype=c).resolve(), "e").compat_hash
              for c in ("auto", "fp8_e4m3", "int8")}
    assert len(set(hashes.values())) == 3


def test_twice_the_tokens_fit_the_same_memory(tmp_path) -> None:
    m = make_model("qwen3", tmp_path / "q", seed=1)
    blocks = {}
    for c in ("auto", "fp8_e4m3"):
        core = EngineCore(EngineConfig.from_flat(model=m, dtype="bfloat16", kv_cache_dtype=c,
                                                 kv_cache_memory=32 << 20).resolve())
        blocks[c] = core.info().num_blocks
        core.shutdown()
    assert blocks["fp8_e4m3"] == 2 * blocks["auto"]


def test_an_unknown_kv_dtype_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8_e4m3, int8"):
        EngineConfig.from_flat(model=make_model("qwen3", tmp_path / "q", seed=1), kv_cache_dtype="fp4").resolve()
