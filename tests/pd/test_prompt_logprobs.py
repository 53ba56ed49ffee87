"""`SamplingParams.prompt_logprobs`: every prompt token scored, held against transformers'
log-softmax over the same checkpoint (float32), through chunked prefill, batching and
preemption; the prefix cache is not read for such a request (its hits would skip rows)."""

from __future__ import annotations

import pytest
import torch

from pd.contracts.request import Request
from pd.contracts.sampling_params import SamplingParams
from pd.llm import LLM
from pd.logprobs import PromptLogprobs
from tests.support.hf_reference import checkpoints, hf_logits, hf_models, random_prompts  # noqa: F401 (fixtures)

K = 5
SCORE = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=K)


def assert_scores_match(scored: PromptLogprobs, prompt: list[int], hf_model) -> None:
    reference = hf_logits(hf_model, prompt)[:-1].log_softmax(-1)  # row p scores token p + 1
    assert (scored.start, scored.end) == (1, len(prompt))
    ids, values = torch.tensor(scored.token_ids), torch.tensor(scored.logprobs)
    assert ids[:, 0].tolist() == prompt[1:]
    assert torch.allclose(values, reference.gather(1, ids), atol=1e-4)
    assert ids[:, 1:].tolist() == reference.topk(K, dim=-1).indices.tolist()
    # The rank counts the vocabulary above the token's logprob: a logprob within our error
    # on the token's own (float32 noise) may sit on either side of it.
    token = reference.gather(1, ids[:, :1])
    noise = (values[:, :1] - token).abs() + 1e-6
    highest, lowest = (reference > token - noise).sum(-1) + 1, (reference > token + noise).sum(-1) + 1
    ranks = torch.tensor(scored.ranks)
    assert ((lowest <= ranks) & (ranks <= highest)).all(), "a rank off by more than float32 noise"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "bamba"])
def test_prompt_logprobs_equal_transformers_through_chunked_prefill(arch, checkpoints, hf_models):
    llm = LLM(str(checkpoints[arch]), max_num_batched_tokens=48, kv_cache_memory=64 << 20)
    prompts = random_prompts([2, 30, 131, 200], seed=11)
    for prompt, out in zip(prompts, llm.generate(prompts, SCORE)):
        assert_scores_match(out.prompt_logprobs, prompt, hf_models(arch))


@pytest.mark.slow
def test_a_cached_prefix_is_recomputed_to_be_scored(checkpoints, hf_models):
    llm = LLM(str(checkpoints["gemma3"]), kv_cache_memory=64 << 20)
    prompt = random_prompts([300], seed=12)[0]
    llm.generate([prompt], SamplingParams(max_tokens=1))
    hits = llm.engine.kv_cache_manager.stats.hits
    out = llm.generate([prompt], SCORE)[0]
    assert llm.engine.kv_cache_manager.stats.hits == hits  # no hit taken
    assert_scores_match(out.prompt_logprobs, prompt, hf_models("gemma3"))
    llm.generate([prompt], SamplingParams(max_tokens=1))
    assert llm.engine.kv_cache_manager.stats.hits > hits  # while a plain request still hits


@pytest.mark.slow
def test_preempted_requests_score_each_prompt_token_once(checkpoints):
    roomy = LLM(str(checkpoints["gemma3"]), kv_cache_memory=64 << 20, max_model_len=512)
    prompts = random_prompts([90 + 7 * i for i in range(6)], seed=13)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, prompt_logprobs=2)
    alone = [roomy.generate([p], params)[0] for p in prompts]
    tight = LLM(str(checkpoints["gemma3"]), max_model_len=512, max_num_batched_tokens=64,
                kv_cache_memory=52 * roomy.engine.kv_cache_config.cross_layer_page_bytes)
    outputs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    for out, ref in zip(outputs, alone):
        assert out.token_ids == ref.token_ids
        assert out.prompt_logprobs.token_ids == ref.prompt_logprobs.token_ids
        assert torch.allclose(torch.tensor(out.prompt_logprobs.logprobs), torch.tensor(ref.prompt_logprobs.logprobs),
                              atol=1e-4)


def test_a_one_token_prompt_has_nothing_to_score(checkpoints):
    llm = LLM(str(checkpoints["qwen3"]), kv_cache_memory=64 << 20)
    scored = llm.generate([[42]], SCORE)[0].prompt_logprobs
    assert (scored.start, scored.end, scored.token_ids) == (1, 1, [])
    assert llm.generate([[42, 43]], SamplingParams(max_tokens=1))[0].prompt_logprobs is None  # not asked


@pytest.mark.parametrize("k", [-1, 21])
def test_prompt_logprobs_out_of_range_is_refused(k):
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=k)


def test_a_request_that_did_not_ask_takes_no_scores():
    request = Request("r", [1, 2, 3])
    with pytest.raises(ValueError, match="did not ask"):
        request.add_prompt_logprobs(PromptLogprobs([[2]], [[-1.0]], [1], start=1))
