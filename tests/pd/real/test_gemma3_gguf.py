"""pd.LLM on the real Gemma 3 270M GGUF against transformers on the same file: greedy
tokens equal in float32; teacher-forced top-1 agreement in bfloat16 over real English
(one forward, and one request per prefix through the prefix cache);
the weights we read equal the weights transformers reads, tensor by tensor, and our GGUF
reader reads the file as gguf's own does."""

from __future__ import annotations

import pytest
import torch

from pd.contracts.sampling_params import SamplingParams
from pd.llm import LLM
from pd.models.gguf import GGUFModel
from pd.models.packed import widens
from pd.tokenizer import Tokenizer
from tests.support.gguf_reference import assert_same_as_the_reference
from tests.support.real_gemma import PROMPTS, gguf_reader, hf_gemma

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

# A disagreement with transformers' bfloat16 top-1 is rounding, not a bug, where float32's
# top-2 margin is under this: two bfloat16 computations of a logit differ by up to ~1.2
# (max |diff| measured), while float32's median top-2 margin over the text is ~1.2.
NEAR_TIE = 0.5
PREFIX_WAVE = 64  # prefixes sent together by the cached-prefix test


def test_every_weight_equals_what_transformers_reads(gemma_gguf) -> None:
    reference = hf_gemma(gemma_gguf, torch.float32).state_dict()
    seen = 0
    for name, tensor in GGUFModel(gemma_gguf).iterate_weights():
        assert torch.equal(tensor, reference[name]), name
        seen += 1
    assert seen == len(reference) - 1  # all but lm_head.weight, tied to the embedding


def test_our_reader_reads_the_real_gemma_as_gguf_s_own_reader_does(gemma_gguf) -> None:
    assert_same_as_the_reference(gemma_gguf, gguf_reader(gemma_gguf))  # the reader transformers got


def test_float32_greedy_tokens_equal_transformers(gemma_gguf) -> None:
    """Each of our 32 greedy tokens is transformers' top-1 after the prompt and our tokens
    before it (one forward of the whole text, ~10x cheaper than its `generate`): so
    transformers' greedy continuation of the prompt is ours, token for token."""
    llm = LLM(str(gemma_gguf), dtype="float32", max_model_len=1024)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    model = hf_gemma(gemma_gguf, torch.float32)
    for out in outputs:
        with torch.inference_mode():
            logits = model(torch.tensor([out.prompt_token_ids + out.token_ids])).logits[0]
        assert logits[len(out.prompt_token_ids) - 1:-1].argmax(-1).tolist() == out.token_ids, out.text
    assert "France" in outputs[0].text  # a base model's continuation, in English


def test_pd_convert_writes_a_folder_transformers_loads(gemma_gguf, tmp_path) -> None:
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "gemma-hf"
    done = subprocess.run([str(Path(sys.executable).parent / "pd"), "convert", str(gemma_gguf), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    assert ids[0].tolist() == Tokenizer(gemma_gguf).encode(PROMPTS[0])  # BOS included, same ids
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.inference_mode():
        got = converted(ids).logits
        expected = hf_gemma(gemma_gguf, torch.float32)(ids).logits
    assert torch.equal(got, expected)


def test_float32_tp2_greedy_tokens_equal_tp1(gemma_gguf) -> None:
    """Two ranks (its one KV head replicated, the 262k vocabulary split) give one rank's
    greedy tokens; each rank read only its slices of the quantized file."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    tokens = {}
    for tp in (1, 2):
        with LLM(str(gemma_gguf), dtype="float32", max_model_len=1024, tensor_parallel_size=tp, num_threads=1) as llm:
            tokens[tp] = [out.token_ids for out in llm.generate(PROMPTS, params)]
    assert tokens[2] == tokens[1]


def test_each_tokenizer_of_the_gguf_is_its_own_and_encodes_alike(gemma_gguf, english_text) -> None:
    """The vocabulary is converted once per process; every Tokenizer gets its own copy."""
    first, second = Tokenizer(gemma_gguf), Tokenizer(gemma_gguf)
    assert first._tokenizer is not second._tokenizer and first.config is not second.config
    first.config["bos_token"] = "changed"
    assert Tokenizer(gemma_gguf).config.get("bos_token") != "changed"
    assert first.encode(english_text) == second.encode(english_text)


@pytest.fixture(scope="module")
def english_tokens(gemma_gguf, english_text) -> list[int]:
    tokens = Tokenizer(gemma_gguf).encode(english_text)[:512]
    assert len(tokens) == 512
    return tokens


@pytest.fixture(scope="module")
def reference_logits(gemma_gguf, english_tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits at every position of the text: (float32, dense bfloat16)."""
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):  # bfloat16 as loaded (model.to() would round RoPE's table)
        with torch.inference_mode():
            logits[dtype] = hf_gemma(gemma_gguf, dtype)(torch.tensor([english_tokens])).logits[0].float()
    hf_gemma.cache_clear()  # the tests above are done with transformers' models (1.6 GB): the worker's peak is below
    return logits[torch.float32], logits[torch.bfloat16]


@pytest.fixture(scope="module")
def bfloat16_llm(gemma_gguf) -> LLM:
    """One bfloat16 engine for the tests below (a load is ~3 s); `fresh` empties its
    prefix cache, so that each test computes what it says it does."""
    return LLM(str(gemma_gguf), dtype="bfloat16", max_model_len=1024, keep_logits=True, quantization="none")


def fresh(llm: LLM) -> LLM:
    assert llm.engine.kv_cache_manager.reset_prefix_cache(), "a request still holds blocks"
    return llm


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_bfloat16_teacher_forced_top1_agrees_with_transformers(bfloat16_llm, english_tokens, reference_logits,
                                                               kernels, monkeypatch) -> None:
    """The text teacher-forced in one request: the prompt's own logprobs score every
    position in one prefill, held against transformers' forward of the same text.
    Agreement counts a position when our top-1 token has the reference's highest logit
    there (bfloat16 logits tie often; either tied token is the top-1).

    torch: with the torch ops (PD_NATIVE_KERNELS=0, or any other device) every op is
    transformers' op in its order, so bfloat16 against bfloat16 agrees at >= 99 % (100 %
    measured); where linears are widened (pd/models/packed.py) it is held as native is.
    native: the CPU kernels (the default here) round in another order (fused
    norm and activation passes, float32 attention scores in place of SDPA's blocks). Then
    any perturbation flips bfloat16 near-ties (transformers' own bfloat16 picks float32's
    top-1 at only ~97.7 % of positions), so the kernels are held to float32, the truth
    both approximate: top-1 agreement with float32 within a point of transformers
    bfloat16's, mean |logprob error| within 10 % of its, >= 97 % with its bfloat16, and
    every disagreement with it a float32 near-tie.
    Measured: 98.4 % with bfloat16, 97.5 % with float32 (transformers bfloat16: 97.7 %)."""
    if kernels == "torch":
        from pd.attention import cpu_kernels
        from pd.models import fused

        monkeypatch.setattr(cpu_kernels, "supports", lambda *args: False)
        monkeypatch.setattr(fused, "supports", lambda *args: False)
    scored = fresh(bfloat16_llm).generate([english_tokens],
                                          SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5))[0]
    ids, ours = torch.tensor(scored.prompt_logprobs.token_ids), torch.tensor(scored.prompt_logprobs.logprobs)
    exact, rounded = (logits[:-1].log_softmax(-1) for logits in reference_logits)  # row p scores token p + 1

    def top1(reference: torch.Tensor) -> torch.Tensor:
        return reference.gather(1, ids[:, 1:2])[:, 0] == reference.max(-1).values

    agree, agree_exact = top1(rounded).float().mean().item(), top1(exact).float().mean().item()
    reference_exact = (rounded.argmax(-1) == exact.argmax(-1)).float().mean().item()
    diff = (ours - rounded.gather(1, ids)).abs()
    error, reference_error = ((x - exact.gather(1, ids)).abs().mean().item() for x in (ours, rounded.gather(1, ids)))
    print(f"bfloat16 ({kernels} kernels) teacher-forced over {len(english_tokens)} tokens: top-1 agreement "
          f"{agree:.4f} with transformers bfloat16, {agree_exact:.4f} with float32 (transformers bfloat16 vs "
          f"float32: {reference_exact:.4f}); |logprob diff| with transformers bfloat16 over the prompt token and "
          f"top 5: max {diff.max().item():.4f}, mean {diff.mean().item():.5f}; mean |logprob - float32| "
          f"{error:.5f} (transformers bfloat16: {reference_error:.5f})")
    if kernels == "torch" and not widens(torch.bfloat16, torch.device("cpu")):
        assert agree >= 0.99
        return
    # the native kernels; or torch's ops with linears widened to float32 (a CPU without
    # oneDNN's bfloat16 kernels), which sum in another order than transformers' (measured
    # there: 99.0 % with its bfloat16)
    assert agree >= 0.97
    assert agree_exact >= reference_exact - 0.01
    assert error <= 1.1 * reference_error
    top2 = exact.topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1])[~top1(rounded)]
    assert (margins < NEAR_TIE).all(), f"a disagreement that is not a near-tie ({margins.max():.3f})"


def test_bfloat16_cached_prefixes_differ_from_transformers_only_at_near_ties(bfloat16_llm, english_tokens,
                                                                          reference_logits) -> None:
    """Position by position, one request per prefix, sent in waves of `PREFIX_WAVE`: each
    wave finds the blocks of the waves before it in the prefix cache, so each request
    computes a few tokens against cached KV in mixed batches, a different order of
    bfloat16 roundings than one forward (sent all at once, most were admitted before
    anything was cached and computed their whole prefix). Its one sampled row of logits
    per position is held against transformers' bfloat16 row.

    transformers in bfloat16 itself picks float32's top-1 at only ~97.7 % of these
    positions: where two tokens are within rounding of each other, any two bfloat16
    computations may differ (here ~97 %). So: >= 96 % agreement, and every disagreement
    must be such a near-tie in float32 (top-2 margin under NEAR_TIE)."""
    tokens, llm, outputs = english_tokens, fresh(bfloat16_llm), []
    stats = llm.engine.kv_cache_manager.stats
    before = stats.queries, stats.hits
    prefixes = [tokens[:k] for k in range(1, len(tokens) + 1)]
    for start in range(0, len(prefixes), PREFIX_WAVE):
        outputs += llm.generate(prefixes[start:start + PREFIX_WAVE], SamplingParams(max_tokens=1, temperature=0))
    hit_rate = (stats.hits - before[1]) / (stats.queries - before[0])
    assert hit_rate > 0.75, f"the waves computed most of their prefixes ({hit_rate:.2f} of tokens hit the cache)"
    ours = torch.stack([out.logits[0] for out in outputs]).float()
    del outputs  # their rows (512 MB) are in `ours` now: this module sets the suite's memory peak
    exact, reference = reference_logits
    agree = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    diff = (ours - reference).abs()
    top2 = exact.topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1])[ours.argmax(-1) != reference.argmax(-1)]
    print(f"bfloat16, one request per prefix over {len(tokens)} tokens ({hit_rate:.2f} of their tokens prefix "
          f"hits): top-1 agreement {agree:.4f} with "
          f"transformers bfloat16, max |logit diff| {diff.max().item():.3f}, mean {diff.mean().item():.4f}, "
          f"float32 margins where we differ {[round(m, 3) for m in margins.tolist()]}")
    assert agree >= 0.96
    assert (margins < NEAR_TIE).all(), "a disagreement that is not a near-tie: a numerical bug, not rounding"


def test_int8_teacher_forced_top1_agreement_with_transformers(gemma_gguf, english_tokens, reference_logits) -> None:
    """`--quantization int8` on the real model, scored as the bfloat16 test above: top-1
    agreement with transformers' bfloat16 over the text, and the mean |logprob error|
    against float32. Every linear is W8A8 (int8 weights and activations, Hadamard-rotated),
    about 1 % of noise per product: measured 97.6 % agreement here (97.5 % over 2,048
    tokens; unquantized bfloat16: 98.4 % and 98.9 %), mean error 2.3x bfloat16's. Without
    the rotation the agreement was 92 %."""
    llm = LLM(str(gemma_gguf), dtype="bfloat16", max_model_len=1024, quantization="int8")
    scored = llm.generate([english_tokens], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5))[0]
    ids, ours = torch.tensor(scored.prompt_logprobs.token_ids), torch.tensor(scored.prompt_logprobs.logprobs)
    exact, rounded = (logits[:-1].log_softmax(-1) for logits in reference_logits)
    agree = (rounded.gather(1, ids[:, 1:2])[:, 0] == rounded.max(-1).values).float().mean().item()
    error = (ours[:, 0] - exact.gather(1, ids[:, :1])[:, 0]).abs().mean().item()
    reference_error = (rounded.gather(1, ids[:, :1]) - exact.gather(1, ids[:, :1])).abs().mean().item()
    print(f"int8 teacher-forced over {len(english_tokens)} tokens: top-1 agreement {agree:.4f} with transformers "
          f"bfloat16; mean |logprob - float32| {error:.5f} (transformers bfloat16: {reference_error:.5f})")
    assert agree >= 0.96
    assert error <= 4 * reference_error


def test_gguf_blocks_agree_with_bfloat16_on_the_dequantized_weights(gemma_gguf, english_text) -> None:
    """`--quantization gguf` (the default for this file on a CPU with the kernels) against
    our bfloat16 engine on the same, dequantized, weights: teacher-forced top-1 agreement
    and perplexity over 2,048 tokens of the text. Activations rounded to 8 bits as
    llama.cpp rounds them (per 32 inputs for Q8_0 and Q5_0 weights, per 256 for Q4_K and
    Q6_K). Each rounding turns on the bits of the layer before, so float32 summation order
    alone moves these figures: over 512 tokens the kernel, its plain C path and the torch
    reference (the same arithmetic) gave perplexity 9.575, 9.589 and 9.617 (a change to the
    kernel's K-quant sums alone moved the first to 9.71: 512 tokens made this test fail on
    noise); over 2,048 5.958, 5.938 and 5.968. Measured here: 96.2 % agreement, perplexity
    +0.3 %."""
    tokens = Tokenizer(gemma_gguf).encode(english_text)[:2048]
    assert len(tokens) == 2048
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    scored = {}
    for quantization in ("none", "gguf"):
        llm = LLM(str(gemma_gguf), dtype="bfloat16", max_model_len=2560, quantization=quantization)
        logprobs = llm.generate([tokens], params)[0].prompt_logprobs
        scored[quantization] = torch.tensor(logprobs.token_ids), torch.tensor(logprobs.logprobs)
        llm.shutdown()
    agree = (scored["gguf"][0][:, 1] == scored["none"][0][:, 1]).float().mean().item()
    perplexity = {name: (-logprobs[:, 0].mean()).exp().item() for name, (_, logprobs) in scored.items()}
    print(f"gguf teacher-forced over {len(tokens)} tokens: top-1 agreement {agree:.4f} with bfloat16; "
          f"perplexity {perplexity['gguf']:.4f} against {perplexity['none']:.4f}")
    assert agree >= 0.95
    assert abs(perplexity["gguf"] / perplexity["none"] - 1) <= 0.02
