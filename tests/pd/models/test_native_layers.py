"""Gemma 3's layers as native plans (`pd.models.native_layers`) compute, bitwise, what its
modules compute: prompt scores and every sampled token's logits, prefill chunks and
decodes in one batch, over every kind of linear and KV cache the plans run with."""

from __future__ import annotations

import pytest
import torch

from pd.contracts.sampling_params import SamplingParams
from pd.llm import LLM
from pd.models import fused
from pd.models.make_model import make_model
from pd.models.native_layers import LayerPlan

PROMPTS = [list(range(5, 75)), list(range(100, 140)), [7, 8, 9]]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return make_model("gemma3", tmp_path_factory.mktemp("gemma3") / "m", seed=2)


def run(llm: LLM, native: bool) -> list:
    llm.engine.model.model.use_native_layers(native)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=1)
    return [(o.token_ids, torch.tensor(o.prompt_logprobs.logprobs), torch.stack(o.logits))
            for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("dtype, quantization, kv_cache_dtype", [
    ("bfloat16", "none", "auto"), ("float32", "none", "auto"), ("bfloat16", "int8", "int8"),
    ("bfloat16", "none", "fp8_e4m3")])
def test_plans_compute_the_modules_bytes(gemma3, dtype, quantization, kv_cache_dtype) -> None:
    # a 16-token budget: the long prompt's chunks share steps with the others' decodes
    with LLM(str(gemma3), keep_logits=True, dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
             max_model_len=128, max_num_batched_tokens=16) as llm:
        model = llm.engine.model.model
        modules = run(llm, False)
        assert not model._plans  # the module path never built a plan
        plans = run(llm, True)
        assert all(isinstance(p, LayerPlan) for p in model._plans[getattr(torch, dtype)])
    for (tokens, prompt, logits), (tokens_p, prompt_p, logits_p) in zip(modules, plans, strict=True):
        assert tokens == tokens_p
        assert torch.equal(prompt, prompt_p) and torch.equal(logits, logits_p)


def test_no_plan_without_the_fused_kernels(gemma3, monkeypatch) -> None:
    """PD_NATIVE_KERNELS=0 (or no compiler): the modules run, on their torch paths."""
    monkeypatch.setattr(fused, "_library", lambda: None)
    with LLM(str(gemma3), dtype="bfloat16", max_model_len=128) as llm:
        out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        assert len(out[0].token_ids) == 3
        assert not llm.engine.model.model._plans  # never built: the modules ran
