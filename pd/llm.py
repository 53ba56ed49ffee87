"""The offline API: `LLM(model_dir).generate(prompts, SamplingParams)`.

Runs the same EngineCore a server runs, in-process: all prompts are queued at once and
batched continuously until every one finishes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from typing import Any, Sequence

import torch

from pd.config import EngineConfig
from pd.engine.core import EngineCore
from pd.request import PromptLogprobs, Request, RequestStatus, SamplingParams
from pd.tokenizer import Tokenizer


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" or "length"
    logits: list[torch.Tensor] | None = None  # one float32 row per sampled token, if kept
    prompt_logprobs: PromptLogprobs | None = None  # when SamplingParams.prompt_logprobs asked


class LLM:
    """Load a model directory and generate from prompts (text or token ids)."""

    _ids = itertools.count()

    def __init__(self, model: str, keep_logits: bool = False, **engine_args: Any) -> None:
        """`engine_args` are EngineConfig fields (dtype, block_size, kv_cache_memory, ...)."""
        self.engine = EngineCore(EngineConfig(model=model, **engine_args), keep_logits=keep_logits)
        self.tokenizer = Tokenizer(model)

    @classmethod
    def from_config(cls, config: EngineConfig, keep_logits: bool = False) -> "LLM":
        return cls(**{f.name: getattr(config, f.name) for f in fields(config) if f.init}, keep_logits=keep_logits)

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[CompletionOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        requests = [Request(f"offline-{next(self._ids)}", self._token_ids(p), sp)
                    for p, sp in zip(prompts, params_list)]
        for request in requests:
            self.engine.add_request(request)
        while self.engine.has_work():
            self.engine.step()
        return [self._output(r) for r in requests]

    def _token_ids(self, prompt: str | list[int]) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("empty prompt")
        return ids

    def _output(self, request: Request) -> CompletionOutput:
        reason = "length" if request.status is RequestStatus.FINISHED_LENGTH_CAPPED else "stop"
        return CompletionOutput(request.prompt_token_ids, list(request.output_token_ids),
                                self.tokenizer.decode(request.output_token_ids), reason,
                                self.engine.logits.pop(request.request_id, None), request.prompt_logprobs)
