"""pd.LLM on `pd make-model` checkpoints, held against transformers on the same files.

Per architecture: a batch of prompts of different lengths goes through chunked prefill
(a small token budget), then 16 greedy decode steps; a second batch shares prefixes with
the first and so starts from prefix-cache hits. Every sampled row of logits must match
transformers' logits for the same tokens (float32, max abs diff <= 1e-3), and greedy
tokens must equal transformers' `generate`.
"""

from __future__ import annotations

import pytest
import torch

from pd.contracts.sampling_params import SamplingParams
from pd.llm import LLM
from tests.support.hf_reference import ARCHS, checkpoints, hf_logits, hf_models, random_prompts  # noqa: F401 (fixtures)

TOLERANCE = 1e-3
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def assert_logits_match(llm_outputs, hf_model) -> float:
    worst = 0.0
    for out in llm_outputs:
        reference = hf_logits(hf_model, out.prompt_token_ids + out.token_ids)
        start = len(out.prompt_token_ids) - 1
        ours = torch.stack(out.logits)
        diff = (ours - reference[start : start + len(out.token_ids)]).abs().max().item()
        worst = max(worst, diff)
    assert worst <= TOLERANCE, f"max abs logit difference {worst:.2e} > {TOLERANCE}"
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers_through_chunked_prefill_prefix_hits_and_decode(arch, checkpoints, hf_models):
    llm = LLM(str(checkpoints[arch]), keep_logits=True, max_num_batched_tokens=96, kv_cache_memory=64 << 20)
    block = llm.engine.kv_cache_config.groups[0].spec.block_size
    first = random_prompts([5, 40, 2 * block + 30, 3 * block + 7], seed=2)
    assert_logits_match(llm.generate(first, GREEDY), hf_models(arch))
    # share the first prompts' prefixes (2 and 3 blocks long): these start from cache hits
    second = [first[2][: 2 * block] + p for p in random_prompts([3, 17], seed=3)]
    second.append(first[3][: 3 * block + 1] + [11])
    hits_before = llm.engine.kv_cache_manager.stats.hits
    assert_logits_match(llm.generate(second, GREEDY), hf_models(arch))
    assert llm.engine.kv_cache_manager.stats.hits - hits_before >= 2 * block * 2 + 3 * block


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_32_greedy_tokens_equal_transformers_generate(arch, checkpoints, hf_models):
    prompts = random_prompts([9, 70, 150], seed=4)
    llm = LLM(str(checkpoints[arch]), kv_cache_memory=64 << 20)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        with torch.inference_mode():
            ref = hf_models(arch).generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32,
                                           do_sample=False, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                           pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_layouts_and_prefix_hits_give_the_same_tokens(arch, checkpoints):
    prompts = random_prompts([20, 200, 333], seed=5)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    runs = {}
    for layout in ("canonical", "per-layer"):
        llm = LLM(str(checkpoints[arch]), kv_layout=layout, kv_cache_memory=64 << 20, max_num_batched_tokens=128)
        cold = [o.token_ids for o in llm.generate(prompts, params)]
        hits = llm.engine.kv_cache_manager.stats.hits
        warm = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.kv_cache_manager.stats.hits > hits, "the second run should hit the prefix cache"
        assert warm == cold
        runs[layout] = cold
    assert runs["canonical"] == runs["per-layer"]


def peak_bytes_held(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[list[int], int]:
    """Generate one prompt step by step; the most KV cache bytes held at any step."""
    from pd.contracts.request import Request

    engine = llm.engine
    request = Request("peak", prompt, params)
    engine.add_request(request)
    usable = engine.kv_cache_config.num_blocks - 1
    row = engine.kv_cache_config.cross_layer_page_bytes
    peak = 0
    while engine.has_work():
        engine.step()
        peak = max(peak, (usable - engine.kv_cache_manager.num_free_blocks) * row)
    return request.output_token_ids, peak


@pytest.mark.slow
def test_gemma3_no_hybrid_kv_cache_same_tokens_more_memory(checkpoints):
    prompt = random_prompts([1500], seed=6)[0]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    results = {}
    for hybrid in (True, False):
        llm = LLM(str(checkpoints["gemma3"]), hybrid_kv_cache=hybrid, kv_cache_memory=64 << 20,
                  max_num_batched_tokens=128, enable_prefix_caching=False)
        kinds = {type(g.spec).__name__ for g in llm.engine.kv_cache_config.groups}
        assert kinds == ({"SlidingWindowSpec", "FullAttentionSpec"} if hybrid else {"FullAttentionSpec"})
        if not hybrid:  # one KV cache group, two attention groups (full and window 128)
            windows = sorted(g.sliding_window or 0 for g in llm.engine.runner.attention_groups)
            assert len(llm.engine.kv_cache_config.groups) == 1 and windows == [0, 128]
        results[hybrid] = peak_bytes_held(llm, prompt, params)
    assert results[True][0] == results[False][0]
    hybrid_bytes, full_bytes = results[True][1], results[False][1]
    # 4 of 6 layers keep only the window plus one chunk (~17 blocks) instead of ~95 blocks:
    # about (2*95 + 4*17) / (6*95) = 0.45 of the bytes
    assert hybrid_bytes < 0.5 * full_bytes, (hybrid_bytes, full_bytes)


def test_no_hybrid_kv_cache_is_refused_for_mamba_hybrids(checkpoints):
    with pytest.raises(ValueError, match="hybrid"):
        LLM(str(checkpoints["bamba"]), hybrid_kv_cache=False, kv_cache_memory=64 << 20)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma3", "bamba"])
def test_preemption_under_a_small_kv_budget_keeps_outputs(arch, checkpoints):
    """Requests admitted with short prompts outgrow a small pool, get preempted and are
    recomputed (Bamba from its cached Mamba states); outputs stay the unbatched ones."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    roomy = LLM(str(checkpoints[arch]), kv_cache_memory=64 << 20, max_model_len=512)
    block = roomy.engine.kv_cache_config.groups[0].spec.block_size
    prompts = random_prompts([max(8, block - 30) + 3 * i for i in range(6)], seed=7)
    alone = [roomy.generate([p], params)[0].token_ids for p in prompts]
    probe = roomy.engine.kv_cache_config
    small_blocks = 16 if arch == "bamba" else 52
    tight = LLM(str(checkpoints[arch]), max_model_len=512, reserve_growth_tokens=0,  # admit, then preempt
                kv_cache_memory=small_blocks * probe.cross_layer_page_bytes)
    outputs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == alone
    assert tight.engine.kv_cache_manager.usage == 0.0
