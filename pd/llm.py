"""The offline API: `LLM(model_dir).generate(prompts, SamplingParams)`.

Runs the same EngineCore a server runs, in-process: all prompts are queued at once and
batched continuously until every one finishes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from pd.config import EngineConfig
from pd.contracts.request import Request, RequestOutput, sequence_id
from pd.contracts.sampling_params import SamplingParams
from pd.engine.core import EngineCore
from pd.logprobs import Logprobs, PromptLogprobs
from pd.tokenizer import Tokenizer


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" or "length" ("abort" or "error" if it did not end on its own)
    logits: list[torch.Tensor] | None = None  # one float32 row per sampled token, if kept
    prompt_logprobs: PromptLogprobs | None = None  # when SamplingParams.prompt_logprobs asked
    logprobs: Logprobs | None = None  # of each token, when SamplingParams.logprobs asked
    index: int = 0  # the sequence, of the prompt's n


class LLM:
    """Load a model directory and generate from prompts (text or token ids)."""

    _ids = itertools.count()

    def __init__(self, model: str, keep_logits: bool = False, **engine_args: Any) -> None:
        """`engine_args` are the engine's settings by their flat names, `pd serve`'s flags
        (dtype, block_size, kv_cache_memory, ...: EngineConfig.from_flat)."""
        self._start(EngineConfig.from_flat(model=model, **engine_args).resolve(), keep_logits)

    def _start(self, config: EngineConfig, keep_logits: bool) -> None:
        self.engine = EngineCore(config, keep_logits=keep_logits)
        self.tokenizer = Tokenizer(config.model.path)

    def shutdown(self) -> None:
        """Stop the engine: its grammar threads, its connector, its tensor-parallel ranks."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @classmethod
    def from_config(cls, config: EngineConfig, keep_logits: bool = False) -> "LLM":
        """An LLM on a resolved config."""
        llm = cls.__new__(cls)
        llm._start(config, keep_logits)
        return llm

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[CompletionOutput]:
        """One output per prompt, or n consecutive ones (sequences 0..n-1) for a prompt
        whose params ask for n > 1."""
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
        outputs = {(r.request_id, i): CompletionOutput(r.prompt_token_ids, [], "", "", index=i,
                                                       logprobs=Logprobs() if r.output_logprobs is not None else None)
                   for r in requests for i in range(r.sampling_params.n)}
        while self.engine.has_work():
            for out in self.engine.step():
                self._add(outputs[(out.request_id, out.index)], out)
        for (request_id, index), output in outputs.items():
            output.text = self.tokenizer.decode(output.token_ids)
            output.logits = self.engine.logits.pop(sequence_id(request_id, index), None)
        return list(outputs.values())

    @staticmethod
    def _add(output: CompletionOutput, out: RequestOutput) -> None:
        output.token_ids += out.new_token_ids
        if out.logprobs is not None and output.logprobs is not None:
            output.logprobs.append(out.logprobs)
        if out.prompt_logprobs is not None:
            output.prompt_logprobs = out.prompt_logprobs
        if out.finish_reason is not None:
            output.finish_reason = out.finish_reason

    def _token_ids(self, prompt: str | list[int]) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("empty prompt")
        return ids
