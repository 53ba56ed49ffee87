"""What a model directory or file holds, checked without torch: the API server process
fails fast on a model it could not load before it starts the engine (which loads torch)."""

from __future__ import annotations

import json
from pathlib import Path

from pd.models.gguf import is_gguf
from pd.models.model_config import ModelConfig
from pd.models.registry import supported_name


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


def check_model(model: str | Path) -> None:
    """Fail fast, before any engine starts, on what would stop loading `model`: no config,
    an architecture we do not serve, no weight files (ValueError / FileNotFoundError)."""
    config = ModelConfig.from_dir(model)
    supported_name(config.architectures)
    if not is_gguf(model):
        safetensors_files(Path(model))
