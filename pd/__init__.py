"""pd-serve: disaggregated prefill/decode LLM serving for hybrid models."""

from typing import Any

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Lazy, so `pd` (the CLI, the KV cache core) imports without torch.
    if name == "LLM":
        from pd.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pd.contracts.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
