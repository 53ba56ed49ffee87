"""Load an HF-format checkpoint directory, or a GGUF file, into one of our model classes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pd.models.base import CausalLM
from pd.models.config import ModelConfig
from pd.models.files import safetensors_files
from pd.models.gguf import is_gguf, open_gguf
from pd.models.registry import model_class
from pd.kv_cache.allocation import torch_dtype


def iterate_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(config: ModelConfig, device: torch.device | str = "cpu") -> CausalLM:
    """Build the model `config.architectures` names on `device` in `config.dtype` and
    load its weights; the model is in eval mode."""
    cls = model_class(config.architectures)
    if is_gguf(config.model_dir):
        weights = open_gguf(config.model_dir).iterate_weights()  # dequantized one tensor at a time
    else:
        weights = iterate_weights(safetensors_files(config.model_dir))  # finds the files now: fails fast
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype(config.dtype))
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        model.load_weights(weights)
    return model.eval()
