"""The engine on a CUDA device: every family gives the CPU's tokens and logits; bfloat16
serves; tensor parallelism over NCCL (one device per rank) gives TP = 1's tokens.

Skipped where torch sees no CUDA device (CI); run on a GPU machine when one is lent."""

from __future__ import annotations

import pytest
import torch

from pd.contracts.sampling_params import SamplingParams
from tests.support.hf_reference import random_prompts
from tests.support.llm_runs import Run, assert_logits_close, llm_run
from tests.support.server_harness import ARCHS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

LOGIT_TOL = 2e-3  # float32 on two devices: summation orders differ (and cuDNN's convolutions may use TF32)
PROMPTS = random_prompts([29, 7, 40], seed=11)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def generate(model, **engine_args) -> Run:
    return llm_run(model, PROMPTS, GREEDY, **engine_args)


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_gives_the_cpu_tokens_and_logits(tiny_models, arch: str) -> None:
    cpu = generate(tiny_models[arch], dtype="float32", device="cpu", num_threads=1)
    cuda = generate(tiny_models[arch], dtype="float32", device="cuda")
    assert cuda[0] == cpu[0]
    assert_logits_close(cpu[1], cuda[1], LOGIT_TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_serves_bfloat16_close_to_float32(tiny_models, arch: str) -> None:
    """bfloat16 rounds every weight and activation: its logits stay within a few per cent
    of float32's (cosine), and its first token (from the prompt alone) is float32's."""
    full = generate(tiny_models[arch], dtype="float32", device="cuda")
    half = generate(tiny_models[arch], dtype="bfloat16", device="cuda")
    for want, got in zip(full[1], half[1], strict=True):
        similarity = torch.nn.functional.cosine_similarity(want[0], got[0], dim=0).item()
        assert similarity > 0.99, similarity
    assert [t[0] for t in half[0]] == [t[0] for t in full[0]]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a device per rank: fewer than 2 here")
@pytest.mark.parametrize("arch", ["qwen3", "bamba"])
def test_tp2_over_nccl_gives_tp1_tokens(tiny_models, arch: str) -> None:
    one = generate(tiny_models[arch], dtype="float32", device="cuda")
    two = generate(tiny_models[arch], dtype="float32", device="cuda", tensor_parallel_size=2)
    assert two[0] == one[0]
    assert_logits_close(one[1], two[1], LOGIT_TOL)
