"""The data the scheduler hands the model runner each step, and what comes back.

The runner keeps its own copy of each scheduled request (token ids, block table rows)
between steps, so a step only carries what changed: whole requests when they (re)enter
the batch, new block ids and progress otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pd.contracts.connector_api import KVConnectorMetadata, KVConnectorOutput
from pd.contracts.sampling_params import SamplingParams
from pd.logprobs import Logprobs, PromptLogprobs


@dataclass(frozen=True)
class NewRequestData:
    """A request entering the runner (first schedule, or resumed after preemption).
    `token_ids`: every token known so far (prompt + outputs); `block_ids`: its whole
    positional block list per KV cache group."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[list[int]]
    num_computed_tokens: int


@dataclass(frozen=True)
class CachedRequestData:
    """A request the runner already holds: blocks appended to each group's list, and
    tokens computed before this step."""

    req_id: str
    new_block_ids: list[list[int]]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    """One step. `num_scheduled_tokens[req_id]` new tokens per request, in batch order
    (new requests first, then cached ones, as listed). `finished_req_ids`: requests the
    runner must forget before this step (finished or preempted since the last one).
    `block_copies`: (source, copy) block ids whose data the runner copies before anything
    else this step (the blocks a forked sequence does not share). `grammar_masks[req_id]`:
    the tokens a request sampling this step may pick (int32 words, bit j of word w for
    token 32 w + j), for requests with a grammar."""

    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: KVConnectorMetadata | None = None
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    grammar_masks: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def drop(self, req_id: str) -> None:
        """Take a request scheduled earlier in this step out (it was preempted): the
        runner forgets it before the step."""
        self.num_scheduled_tokens.pop(req_id, None)
        self.cached_requests = [c for c in self.cached_requests if c.req_id != req_id]
        self.new_requests = [r for r in self.new_requests if r.req_id != req_id]
        self.finished_req_ids.add(req_id)


@dataclass
class ModelRunnerOutput:
    """Tokens sampled this step, for requests whose known tokens are all computed (a
    prefill chunk short of the prompt's end samples nothing). A request that forks into
    n sequences at this token has the first tokens of sequences 1..n-1 in
    `fork_token_ids`; `logprobs[req_id]` scores its sampled tokens (sequence 0 first),
    when it asked. `logits[req_id]` (float32, the row sampled from) only when the runner
    keeps logits."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    fork_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    logits: dict[str, torch.Tensor] | None = None
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)  # scored this step
    kv_connector_output: KVConnectorOutput = field(default_factory=KVConnectorOutput)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why its step failed


