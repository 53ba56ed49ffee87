"""Load an HF-format checkpoint directory, or a GGUF file, into one of our model classes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pd.models.base import CausalLM
from pd.models.config import ModelConfig
from pd.models.gguf import is_gguf, open_gguf
from pd.models.registry import model_class
from pd.worker.kv_allocation import torch_dtype


def safetensors_files(model_dir: Path) -> list[Path]:
    """`model.safetensors`, or the shards a `model.safetensors.index.json` lists."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{model_dir} has no model.safetensors nor model.safetensors.index.json")


def iterate_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def check_model(model: str | Path) -> None:
    """Fail fast, before any engine starts, on what would stop loading `model`: no config,
    an architecture we do not serve, no weight files (ValueError / FileNotFoundError)."""
    config = ModelConfig.from_dir(model)
    model_class(config.architectures)
    if not is_gguf(model):
        safetensors_files(Path(model))


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
