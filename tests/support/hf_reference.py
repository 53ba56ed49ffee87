"""Tiny `pd make-model` checkpoints of every family and transformers models of the same
files: the reference the engine is held against."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pd.models.make_model import make_model

ARCHS = ["qwen3", "gemma3", "bamba", "granitehybrid"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(arch, root / arch, seed=1) for arch in ARCHS}


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = AutoModelForCausalLM.from_pretrained(checkpoints[arch], dtype=torch.float32).eval()
        return cache[arch]

    return get


def random_prompts(lengths: list[int], seed: int, vocab: int = 4096) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab - 16, (n,), generator=gen).tolist() for n in lengths]


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()
