"""Load an HF-format checkpoint directory, or a GGUF file, into one of our model classes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pd.kv_cache.allocation import torch_dtype
from pd.models.base import CausalLM
from pd.models.files import safetensors_files
from pd.models.gguf import is_gguf, open_gguf
from pd.models.model_config import ModelConfig
from pd.models.registry import model_class
from telemetry.progress import Progress


def iterate_weights(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) of every weight: indexing the slice reads only those rows or
    columns from the file, so a tensor-parallel rank reads its share of a weight."""
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def count_weights(files: list[Path]) -> int:
    """How many weights `iterate_weights(files)` yields (read from the files' headers)."""
    total = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            total += len(f.keys())
    return total


# torch.nn.init's random fills, which layers call from reset_parameters when built.
_RANDOM_INITS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                 "xavier_uniform_", "xavier_normal_")


@contextlib.contextmanager
def _no_random_init() -> Iterator[None]:
    """Build layers without filling their parameters with random numbers: every
    parameter is then loaded from the checkpoint, or load_weights raises. The fills cost
    1.8 s of Gemma 3 270M's load, for numbers that are all overwritten. (The fills are
    replaced process-wide while the model is built.)"""
    saved = {name: getattr(torch.nn.init, name) for name in _RANDOM_INITS}
    for name in _RANDOM_INITS:
        setattr(torch.nn.init, name, _keep)
    try:
        yield
    finally:
        for name, fill in saved.items():
            setattr(torch.nn.init, name, fill)


def _keep(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def model_skeleton(config: ModelConfig, device: torch.device | str = "meta") -> CausalLM:
    """The model `config.architectures` names, built on `device` in `config.dtype`, its
    parameters not filled (on `meta`: shapes only, no memory)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype(config.dtype))
    try:
        with torch.device(device), _no_random_init():
            return model_class(config.architectures)(config)
    finally:
        torch.set_default_dtype(previous)


def load_model(config: ModelConfig, device: torch.device | str = "cpu") -> CausalLM:
    """Build the model `config.architectures` names on `device` in `config.dtype` and
    load its weights; the model is in eval mode. Rank 0 shows the progress per tensor on
    stderr (`telemetry.progress`: a bar on a terminal, a few lines in a server's log)."""
    if is_gguf(config.model_dir):
        weights = list(open_gguf(config.model_dir).lazy_weights())  # each read and dequantized when narrowed
        total = len(weights)
    else:
        files = safetensors_files(config.model_dir)  # finds the files now: fails fast
        weights, total = iterate_weights(files), count_weights(files)
    model = model_skeleton(config, device)
    with torch.no_grad(), Progress("loading weights", total, "tensors", enabled=config.tp.rank == 0) as progress:
        model.load_weights(progress.track(weights))
    return model.eval()
