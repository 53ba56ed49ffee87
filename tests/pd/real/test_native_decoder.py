"""The real Gemma's decoder layers in one native call a step (`pd.models.native_decoder`)
compute, bitwise, what its native layer plans compute one kernel at a time: prompt scores
and every sampled token's logits, prefill chunks and decodes sharing steps; and a step the
call cannot take (an int8 KV cache) runs on the plans."""

from __future__ import annotations

import pytest
import torch

from pd.contracts.sampling_params import SamplingParams
from pd.llm import LLM
from pd.models import native_decoder

pytestmark = pytest.mark.slow

PROMPTS = [list(range(1000, 1070)), list(range(2000, 2040)), [7, 8, 9]]


@pytest.fixture
def decoder_steps(monkeypatch) -> dict[str, int]:
    """Steps the decoder was asked to run, and those it ran (did not hand to the plans)."""
    steps = {"asked": 0, "ran": 0}
    call = native_decoder.NativeDecoder.__call__

    def counted(self, positions, x):
        out = call(self, positions, x)
        steps["asked"] += 1
        steps["ran"] += out is not None
        return out

    monkeypatch.setattr(native_decoder.NativeDecoder, "__call__", counted)
    return steps


def run(llm: LLM, decoder: bool) -> list:
    llm.engine.model.model.use_native_decoder(decoder)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=1)
    return [(o.token_ids, torch.tensor(o.prompt_logprobs.logprobs), torch.stack(o.logits))
            for o in llm.generate(PROMPTS, params)]


def assert_same(a: list, b: list) -> None:
    for (tokens, prompt, logits), (tokens_b, prompt_b, logits_b) in zip(a, b, strict=True):
        assert tokens == tokens_b
        assert torch.equal(prompt, prompt_b) and torch.equal(logits, logits_b)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_decoder_computes_the_plans_bytes(gemma_gguf, decoder_steps, dtype) -> None:
    # a 16-token budget: the long prompt's chunks share steps with the others' decodes
    with LLM(str(gemma_gguf), keep_logits=True, dtype=dtype, quantization="gguf", max_model_len=128,
             max_num_batched_tokens=16) as llm:
        plans = run(llm, False)
        assert decoder_steps == {"asked": 0, "ran": 0}
        decoded = run(llm, True)
    assert decoder_steps["ran"] == decoder_steps["asked"] >= 10  # every step, one call
    assert_same(plans, decoded)


def test_a_step_the_decoder_cannot_take_runs_on_the_plans(gemma_gguf, decoder_steps) -> None:
    with LLM(str(gemma_gguf), keep_logits=True, kv_cache_dtype="int8", max_model_len=128,
             max_num_batched_tokens=16) as llm:
        decoded = run(llm, True)
        plans = run(llm, False)
    assert decoder_steps["asked"] >= 10 and decoder_steps["ran"] == 0
    assert_same(plans, decoded)
