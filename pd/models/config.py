"""ModelConfig: a checkpoint directory's config.json and the choices made serving it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    """`hf_config` is config.json as published; `dtype` the weights' and KV cache's dtype
    name; `max_model_len` defaults to the model's `max_position_embeddings`."""

    model_dir: Path
    hf_config: dict[str, Any]
    dtype: str = "float32"
    max_model_len: int | None = None
    generation_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(SUPPORTED_DTYPES)}, got {self.dtype!r}")
        if not self.architectures:
            raise ValueError(f"{self.model_dir}/config.json names no `architectures`")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")

    @classmethod
    def from_dir(cls, model_dir: str | Path, dtype: str = "float32",
                 max_model_len: int | None = None) -> "ModelConfig":
        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{model_dir} is not a model directory: no config.json")
        hf_config = json.loads(config_path.read_text(), object_hook=_decode_float)
        hf_config = hf_config.get("text_config", hf_config) | {"architectures": hf_config.get("architectures")}
        gen_path = model_dir / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls(model_dir, hf_config, dtype, max_model_len, gen)

    @property
    def architectures(self) -> list[str]:
        return list(self.hf_config.get("architectures") or [])

    def get(self, key: str, default: Any = None) -> Any:
        value = self.hf_config.get(key)
        return default if value is None else value

    def require(self, key: str) -> Any:
        """A config.json value the model cannot do without; ValueError naming it if absent."""
        value = self.hf_config.get(key)
        if value is None:
            raise ValueError(f"{self.model_dir}/config.json lacks {key!r}")
        return value

    @property
    def vocab_size(self) -> int:
        return self.require("vocab_size")

    @property
    def context_len(self) -> int:
        """The longest sequence served: `max_model_len`, else the model's limit."""
        return self.max_model_len or self.get("max_position_embeddings", 2048)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """End-of-sequence ids from generation_config.json and config.json."""
        ids: set[int] = set()
        for source in (self.generation_config, self.hf_config):
            value = source.get("eos_token_id")
            if value is not None:
                ids.update(value if isinstance(value, list) else [value])
        return frozenset(ids)


def _decode_float(obj: dict[str, Any]) -> Any:
    """transformers 5 writes infinities in config.json as {"__float__": "Infinity"}."""
    if set(obj) == {"__float__"}:
        return float(obj["__float__"])  # float() parses "Infinity", "-Infinity", "NaN"
    return obj
