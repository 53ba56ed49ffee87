"""Model classes by the `architectures` name in config.json, imported lazily."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the classes (and torch) load only when one is asked for
    from pd.models.base import CausalLM

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "pd.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "pd.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "pd.models.llama:Qwen3ForCausalLM",
    "Gemma3ForCausalLM": "pd.models.gemma3:Gemma3ForCausalLM",
    "BambaForCausalLM": "pd.models.bamba:BambaForCausalLM",
    "GraniteMoeHybridForCausalLM": "pd.models.bamba:GraniteMoeHybridForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def supported_name(architectures: list[str]) -> str:
    """The first name in `architectures` we serve (ValueError if none), without importing
    its class."""
    for name in architectures:
        if name in _MODELS:
            return name
    raise ValueError(f"unsupported architecture {architectures}; supported: {', '.join(supported_architectures())}")


def model_class(architectures: list[str]) -> type[CausalLM]:
    """The class for the first supported name in `architectures`."""
    module_name, class_name = _MODELS[supported_name(architectures)].split(":")
    return getattr(importlib.import_module(module_name), class_name)
