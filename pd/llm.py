"""The offline API: `LLM(model_dir).generate(prompts, SamplingParams)`.

Runs the same scheduler, KV cache manager and model runner a server runs, in-process:
all prompts are queued at once and batched continuously until every one finishes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from typing import Any, Sequence

import torch

from pd.config import EngineConfig
from pd.kv_cache.layout import make_kv_cache_config
from pd.kv_cache.manager import KVCacheManager
from pd.models.config import ModelConfig
from pd.models.loader import load_model
from pd.request import Request, SamplingParams
from pd.scheduler import Scheduler, SchedulerConfig
from pd.tokenizer import Tokenizer
from pd.worker.model_runner import ModelRunner


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" or "length"
    logits: list[torch.Tensor] | None = None  # one float32 row per sampled token, if kept


class Engine:
    """Scheduler + KV cache manager + model runner in one process, stepped by hand."""

    def __init__(self, config: EngineConfig, keep_logits: bool = False) -> None:
        torch.manual_seed(config.seed)
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model, config.dtype, config.max_model_len)
        device = config.torch_device
        self.model = load_model(self.model_config, device)
        self.max_model_len = self.model_config.context_len
        specs = self.model.kv_cache_specs(config.block_size, hybrid=config.hybrid_kv_cache)
        self.kv_cache_config = make_kv_cache_config(specs, config.kv_cache_memory, self.max_model_len)
        self.kv_cache_manager = KVCacheManager(self.kv_cache_config, config.enable_prefix_caching,
                                               self.max_model_len)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                            self.model_config.eos_token_ids),
            self.kv_cache_manager)
        self.runner = ModelRunner(self.model, self.kv_cache_config, max_num_reqs=config.max_num_seqs,
                                  max_model_len=self.max_model_len, device=device,
                                  layout=config.kv_layout, keep_logits=keep_logits)
        self.logits: dict[str, list[torch.Tensor]] = {}

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def step(self) -> list[Request]:
        """One schedule -> execute -> update; returns the requests that finished."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute_model(scheduler_output)
        if runner_output.logits:
            for req_id, row in runner_output.logits.items():
                self.logits.setdefault(req_id, []).append(row)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests


class LLM:
    """Load a model directory and generate from prompts (text or token ids)."""

    _ids = itertools.count()

    def __init__(self, model: str, keep_logits: bool = False, **engine_args: Any) -> None:
        """`engine_args` are EngineConfig fields (dtype, block_size, kv_cache_memory, ...)."""
        self.engine = Engine(EngineConfig(model=model, **engine_args), keep_logits=keep_logits)
        self.tokenizer = Tokenizer(model)

    @classmethod
    def from_config(cls, config: EngineConfig, keep_logits: bool = False) -> "LLM":
        return cls(**{f.name: getattr(config, f.name) for f in fields(config)}, keep_logits=keep_logits)

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
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return [self._output(r) for r in requests]

    def _token_ids(self, prompt: str | list[int]) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("empty prompt")
        return ids

    def _output(self, request: Request) -> CompletionOutput:
        reason = "length" if request.status.name == "FINISHED_LENGTH_CAPPED" else "stop"
        return CompletionOutput(request.prompt_token_ids, list(request.output_token_ids),
                                self.tokenizer.decode(request.output_token_ids), reason,
                                self.engine.logits.pop(request.request_id, None))
