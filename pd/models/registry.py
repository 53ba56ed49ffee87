"""Model classes by the `architectures` name in config.json, imported lazily (pd/registry.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pd.registry import Registry

if TYPE_CHECKING:  # the classes (and torch) load only when one is asked for
    from pd.models.base import CausalLM

MODELS = Registry("architecture", {
    "LlamaForCausalLM": "pd.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "pd.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "pd.models.llama:Qwen3ForCausalLM",
    "Gemma3ForCausalLM": "pd.models.gemma3:Gemma3ForCausalLM",
    "BambaForCausalLM": "pd.models.bamba:BambaForCausalLM",
    "GraniteMoeHybridForCausalLM": "pd.models.bamba:GraniteMoeHybridForCausalLM",
})


def supported_name(architectures: list[str]) -> str:
    """The first name in `architectures` we serve (ValueError if none), without importing
    its class."""
    for name in architectures:
        if name in MODELS:
            return name
    raise ValueError(f"unsupported architecture {architectures}; supported: {', '.join(MODELS.names())}")


def model_class(architectures: list[str]) -> type[CausalLM]:
    """The class for the first supported name in `architectures`."""
    return MODELS.get(supported_name(architectures))
