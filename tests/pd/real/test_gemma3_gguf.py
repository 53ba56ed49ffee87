"""pd.LLM on the real Gemma 3 270M GGUF against transformers on the same file: greedy
tokens equal in float32 (one rank and two); the weights we read equal the weights
transformers reads, tensor by tensor, and our GGUF reader reads the file as gguf's own
does; `pd convert` writes a folder transformers loads. (bfloat16 and int8 against
transformers: test_gemma3_agreement.py, a module of its own so that the two heavy halves
run on two workers.)"""

from __future__ import annotations

import pytest
import torch

from pd.llm import LLM
from pd.models.gguf import GGUFModel
from pd.scheduling.sampling_params import SamplingParams
from pd.tokenizer import Tokenizer
from tests.support.gguf_reference import assert_same_as_the_reference
from tests.support.real_gemma import PROMPTS, gguf_reader, hf_gemma

pytestmark = [pytest.mark.slow, pytest.mark.heavy]



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
