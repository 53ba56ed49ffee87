"""Sampled tokens' logprobs, and n > 1 sequences forked from one prefill, through pd.LLM:
logprobs held against transformers' log-softmax (with bias and penalties: against a
brute-force computation of the adjusted logits), each forked sequence against a separate
request seeded as it is, for every architecture (the fork copies the block each KV cache
group is writing: attention's last block, the sliding window's, the Mamba state)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from pd.contracts.sampling_params import SamplingParams
from pd.llm import LLM
from tests.support.hf_reference import ARCHS, checkpoints, hf_logits, hf_models, random_prompts  # noqa: F401 (fixtures)
from tests.support.sampling_reference import brute_force_penalized

K = 4
ATOL = 1e-4


def assert_rows_match(rows, token_ids: list[int], reference: torch.Tensor) -> None:
    """`rows` score `token_ids`, each against the matching row of reference logprobs."""
    ids, values = torch.tensor(rows.token_ids), torch.tensor(rows.logprobs)
    assert ids[:, 0].tolist() == token_ids
    assert torch.allclose(values, reference.gather(1, ids).float(), atol=ATOL)
    assert ids[:, 1:].tolist() == reference.topk(ids.shape[1] - 1, dim=-1).indices.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "bamba"])
def test_sampled_token_logprobs_equal_transformers(arch, checkpoints, hf_models):
    llm = LLM(str(checkpoints[arch]), kv_cache_memory=64 << 20)
    prompts = random_prompts([3, 40, 150], seed=21)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=K)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        logits = hf_logits(hf_models(arch), prompt + out.token_ids)
        assert_rows_match(out.logprobs, out.token_ids, logits[len(prompt) - 1:-1].log_softmax(-1))


@pytest.mark.slow
def test_logprobs_come_after_bias_and_penalties_before_temperature(checkpoints, hf_models):
    """A seeded sampled request with a bias and every penalty: each token's logprobs are
    the log-softmax of transformers' logits with that bias and those penalties applied
    (brute force, over the tokens so far), not divided by the temperature."""
    llm = LLM(str(checkpoints["qwen3"]), kv_cache_memory=64 << 20)
    prompt = random_prompts([30], seed=22)[0]
    bias = ((prompt[3], 4.0), (77, -3.0))
    params = SamplingParams(max_tokens=10, temperature=1.7, seed=3, ignore_eos=True, logprobs=K, logit_bias=bias,
                            presence_penalty=0.6, frequency_penalty=0.3, repetition_penalty=1.4)
    out = llm.generate([prompt], params)[0]
    logits = hf_logits(hf_models("qwen3"), prompt + out.token_ids)
    history = prompt + out.token_ids
    for i in range(len(out.token_ids)):
        row = logits[len(prompt) - 1 + i].clone()
        for token, value in bias:
            row[token] += value
        adjusted = brute_force_penalized(row, history[:len(prompt) + i], len(prompt), 0.6, 0.3, 1.4)
        assert_rows_match(out.logprobs.rows(i, i + 1), out.token_ids[i:i + 1], adjusted.log_softmax(-1)[None])


@pytest.mark.slow
def test_raw_logprobs_mode_scores_from_the_models_logits(checkpoints, hf_models):
    """`--logprobs-mode raw` (vLLM's default): the same request, biased and penalized,
    chooses the same tokens, scored by the model's own log-softmax."""
    prompt = random_prompts([30], seed=22)[0]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=K, logit_bias=((prompt[3], 4.0),),
                            presence_penalty=0.6, repetition_penalty=1.4)
    processed = LLM(str(checkpoints["qwen3"]), kv_cache_memory=64 << 20).generate([prompt], params)[0]
    raw = LLM(str(checkpoints["qwen3"]), kv_cache_memory=64 << 20, logprobs_mode="raw").generate([prompt], params)[0]
    assert raw.token_ids == processed.token_ids and raw.logprobs.logprobs != processed.logprobs.logprobs
    logits = hf_logits(hf_models("qwen3"), prompt + raw.token_ids)
    assert_rows_match(raw.logprobs, raw.token_ids, logits[len(prompt) - 1:-1].log_softmax(-1))


def seeded(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True, logprobs=2, n=n, **kw)


def separately(llm: LLM, prompt: list[int], params: SamplingParams) -> list:
    """Sequence j as a request of its own, seeded as the fork seeds it."""
    return [llm.generate([prompt], msgspec.structs.replace(params, n=1, seed=params.seed + j))[0]
            for j in range(params.n)]


def assert_same_sequences(forked: list, alone: list) -> None:
    assert [o.index for o in forked] == list(range(len(alone)))
    for out, ref in zip(forked, alone):
        assert out.token_ids == ref.token_ids and len(out.token_ids) == 12
        assert out.logprobs.token_ids == ref.logprobs.token_ids
        assert torch.allclose(torch.tensor(out.logprobs.logprobs), torch.tensor(ref.logprobs.logprobs), atol=ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_n_sequences_share_one_prefill_and_equal_separate_requests(arch, checkpoints):
    """Prompts ending on and between block boundaries (16 for attention, 144 for the
    hybrids' Mamba blocks). The prompt is computed once for all n sequences; every block
    is back in the pool afterwards."""
    llm = LLM(str(checkpoints[arch]), kv_cache_memory=64 << 20)
    prompts = random_prompts([16, 37, 144, 150], seed=23)
    params = seeded(4)
    computed_before = llm.engine.scheduler.prompt_sources.counts.get("computed", 0)
    outputs = llm.generate(prompts, params)
    assert llm.engine.scheduler.prompt_sources.counts["computed"] - computed_before == sum(map(len, prompts))
    assert llm.engine.kv_cache_manager.usage == 0.0
    llm.engine.kv_cache_manager.check_integrity()
    for i, prompt in enumerate(prompts):
        forked = outputs[4 * i:4 * i + 4]
        assert len({tuple(o.token_ids) for o in forked}) == 4  # differently seeded, they differ
        assert_same_sequences(forked, separately(llm, prompt, params))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma3", "bamba"])
def test_sequences_that_find_no_room_wait_and_are_recomputed_alike(arch, checkpoints):
    """A batch of 2 sequences at most: two of the four wait at the fork and are computed
    later from the prefix cache, with the same tokens; a greedy n gives n equal answers."""
    roomy = LLM(str(checkpoints[arch]), kv_cache_memory=64 << 20)
    tight = LLM(str(checkpoints[arch]), kv_cache_memory=64 << 20, max_num_seqs=2)
    prompt = random_prompts([150], seed=24)[0]
    assert_same_sequences(tight.generate([prompt], seeded(4)), roomy.generate([prompt], seeded(4)))
    assert tight.engine.kv_cache_manager.usage == 0.0
    greedy = tight.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, n=3))
    assert [o.index for o in greedy] == [0, 1, 2] and len({tuple(o.token_ids) for o in greedy}) == 1


def test_a_sequence_its_first_token_stops_holds_nothing(checkpoints):
    llm = LLM(str(checkpoints["qwen3"]), kv_cache_memory=64 << 20)
    outputs = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, temperature=1.0, seed=1, n=5))
    assert [(o.index, len(o.token_ids), o.finish_reason) for o in outputs] == [(i, 1, "length") for i in range(5)]
    assert llm.engine.kv_cache_manager.usage == 0.0 and not llm.engine.scheduler.requests
    llm.engine.kv_cache_manager.check_integrity()
