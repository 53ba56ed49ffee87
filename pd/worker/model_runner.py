"""The model runner: turns a SchedulerOutput into one forward pass and sampled tokens.

It owns the model, the KV cache memory, one block table per KV cache group and a copy
of every scheduled request's tokens. Per step: forget finished requests, take in new
ones and new blocks, lay out the batch (input ids, positions, per-group slot mappings),
build metadata once per attention group, run the model, sample.

A fault while computing a batch (an exception from the model, the metadata or the
sampler) fails the requests of that batch, reported in `ModelRunnerOutput.failed`; the
runner and the engine go on. A CUDA error is not contained: the device context is
then unusable, and the engine stops; nor is a lost tensor-parallel rank (`RankLost`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from pd.attention.backend import CommonAttentionMetadata
from pd.attention.group import AttentionGroup, make_attention_groups
from pd.contracts.connector_api import KVConnectorWorker
from pd.contracts.outputs import ModelRunnerOutput, NewRequestData, SchedulerOutput
from pd.contracts.sampling_params import SamplingParams
from pd.distributed.collectives import RankLost
from pd.forward_context import ForwardContext, set_forward_context
from pd.kv_cache.allocation import KVLayout, allocate_kv_caches
from pd.kv_cache.spec import KVCacheConfig
from pd.logprobs import Logprobs, PromptLogprobs
from pd.models.base import CausalLM
from pd.worker.block_table import BlockTable, MultiGroupBlockTable
from pd.worker.sampler import adjust, choose, make_generator, mask_tokens
from pd.worker.scoring import prompt_logprobs, sampled_logprobs

logger = logging.getLogger(__name__)


@dataclass
class RunnerRequest:
    """The runner's copy of a request: every known token, its block table row."""

    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    row: int
    num_computed_tokens: int


@dataclass
class BatchInputs:
    req_ids: list[str]
    input_ids: torch.Tensor
    positions: torch.Tensor
    common: list[CommonAttentionMetadata]  # per KV cache group
    query_start: np.ndarray  # each request's first row in the batch, and the end
    computed: np.ndarray  # each request's tokens computed before this step
    logits_indices: torch.Tensor
    sampling_req_ids: list[str]


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache_config: KVCacheConfig, *, max_num_reqs: int,
                 max_model_len: int, device: torch.device | str, layout: KVLayout = "canonical",
                 connector: KVConnectorWorker, keep_logits: bool = False,
                 eos_token_ids: frozenset[int] = frozenset(), logprobs_mode: str = "processed",
                 first_heads: list[tuple[int, int]] | None = None) -> None:
        """`first_heads[g]`: the global index of KV cache group g's first head and Mamba
        group on this tensor-parallel rank (the pieces its connector hands out)."""
        self.model = model
        self.eos_token_ids = eos_token_ids  # what min_tokens holds back
        self.logprobs_mode = logprobs_mode  # pd/logprobs.py
        self.kv_cache_config = kv_cache_config
        self.device = torch.device(device)
        self.keep_logits = keep_logits
        self.kv_allocation = allocate_kv_caches(kv_cache_config, self.device, layout)
        self.attention_groups: list[AttentionGroup] = make_attention_groups(
            model.kv_cache_layers(), kv_cache_config, self.device)
        self.block_tables = MultiGroupBlockTable(kv_cache_config.block_sizes, max_num_reqs, max_model_len, self.device)
        self.requests: dict[str, RunnerRequest] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.connector = connector  # NullConnectorWorker when serving alone
        self.connector.register_kv_caches(self.kv_allocation.describe(first_heads))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.kv_allocation.copy_blocks(scheduler_output.block_copies)  # before any KV is written
        self._update_requests(scheduler_output)
        if scheduler_output.kv_connector_metadata is not None:
            self.connector.start_load_kv(scheduler_output.kv_connector_metadata)
        output = ModelRunnerOutput()
        if scheduler_output.num_scheduled_tokens:
            output = self._compute_contained(scheduler_output)
        output.kv_connector_output = self.connector.get_finished(scheduler_output.finished_req_ids)
        return output

    def shutdown(self) -> None:
        self.connector.shutdown()

    def _compute_contained(self, so: SchedulerOutput) -> ModelRunnerOutput:
        try:
            return self._compute(so)
        except Exception as exc:
            if "CUDA error" in str(exc) or isinstance(exc, RankLost):
                raise
            logger.exception("computing a batch of %d requests failed; failing them", len(so.num_scheduled_tokens))
            return ModelRunnerOutput(failed=dict.fromkeys(so.num_scheduled_tokens, f"{type(exc).__name__}: {exc}"))

    def _compute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        batch = self._prepare_inputs(so)
        context = ForwardContext(self._build_metadata(batch.common), self.kv_allocation.layer_caches)
        with torch.inference_mode(), set_forward_context(context):
            hidden = self.model(batch.input_ids, batch.positions)
            logits = self.model.compute_logits(hidden[batch.logits_indices])
            scored = self._score_prompts(batch, hidden)
        output = self._sample(batch.sampling_req_ids, logits, so.grammar_masks)
        output.prompt_logprobs = scored
        return output

    def _score_prompts(self, batch: BatchInputs, hidden: torch.Tensor) -> dict[str, PromptLogprobs]:
        """Logprobs of the prompt tokens this step's rows predict, for requests asking."""
        scored = {}
        for i, req_id in enumerate(batch.req_ids):
            state = self.requests[req_id]
            k = state.sampling_params.prompt_logprobs
            computed, row = int(batch.computed[i]), int(batch.query_start[i])
            first = computed + 1  # the row of position p scores prompt token p + 1
            end = min(int(batch.query_start[i + 1]) - row + computed + 1, state.num_prompt_tokens)
            if k is not None and first < end:
                rows = hidden[row : row + end - first]
                scored[req_id] = prompt_logprobs(self.model, rows, state.token_ids[first:end], k, first)
        return scored

    def _update_requests(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self.free_rows.append(state.row)
        for new in so.new_requests:
            self._add_request(new)
        for cached in so.cached_requests:
            state = self.requests[cached.req_id]
            state.num_computed_tokens = cached.num_computed_tokens
            self.block_tables.append(state.row, cached.new_block_ids)

    def _add_request(self, new: NewRequestData) -> None:
        if new.req_id in self.requests:
            raise ValueError(f"request {new.req_id!r} is already in the model runner")
        if not self.free_rows:
            raise RuntimeError("more requests scheduled than the runner's max_num_reqs")
        row = self.free_rows.pop()
        drawn = len(new.token_ids) - new.num_prompt_tokens  # tokens sampled before it came here
        generator = make_generator(new.sampling_params.seed, self.device, drawn)
        self.requests[new.req_id] = RunnerRequest(
            list(new.token_ids), new.num_prompt_tokens, new.sampling_params, generator, row, new.num_computed_tokens)
        self.block_tables.set_row(row, new.block_ids)

    def _prepare_inputs(self, so: SchedulerOutput) -> BatchInputs:
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        num_new = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        computed = np.array([s.num_computed_tokens for s in states], dtype=np.int64)
        query_start = np.concatenate(([0], np.cumsum(num_new)))
        rows = np.array([s.row for s in states], dtype=np.int64)
        positions = np.repeat(computed - query_start[:-1], num_new) + np.arange(query_start[-1])
        input_ids = [t for s, c, n in zip(states, computed, num_new) for t in s.token_ids[c : c + n]]
        samples = [i for i, s in enumerate(states) if computed[i] + num_new[i] >= len(s.token_ids)]
        seq_lens = computed + num_new
        token_rows = np.repeat(rows, num_new)
        common = [self._common_metadata(table, rows, token_rows, positions, query_start, computed, seq_lens)
                  for table in self.block_tables.tables]
        to_device = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64)).to(self.device)  # noqa: E731
        return BatchInputs(req_ids, to_device(input_ids), to_device(positions), common, query_start, computed,
                           to_device(query_start[1:][samples] - 1), [req_ids[i] for i in samples])

    def _common_metadata(self, table: BlockTable, rows: np.ndarray, token_rows: np.ndarray, positions: np.ndarray,
                         query_start: np.ndarray, computed: np.ndarray,
                         seq_lens: np.ndarray) -> CommonAttentionMetadata:
        _, block_table = table.batch(rows)
        slots = table.slot_mapping(token_rows, positions)
        return CommonAttentionMetadata(
            query_start_loc_cpu=query_start.tolist(),
            num_computed_tokens_cpu=computed.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            query_start_loc=torch.from_numpy(query_start.astype(np.int32)).to(self.device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(self.device),
            block_table=block_table,
            slot_mapping=torch.from_numpy(slots).to(self.device),
            block_size=table.block_size,
        )

    def _build_metadata(self, common: list[CommonAttentionMetadata]) -> dict[str, object]:
        """Metadata once per attention group, shared by the group's layers."""
        per_layer: dict[str, object] = {}
        for group in self.attention_groups:
            metadata = group.builder.build(common[group.kv_cache_group_id])
            for name in group.layer_names:
                per_layer[name] = metadata
        return per_layer

    def _sample(self, req_ids: list[str], logits: torch.Tensor,
                grammar_masks: dict[str, np.ndarray] | None = None) -> ModelRunnerOutput:
        """One token per request; n tokens from the same row for a request that forks
        into n sequences at its first token (sequence j with `for_sequence(j)`'s params
        and a generator of its own). A request's grammar mask comes first; logprobs of
        the sampled tokens, for requests asking, come from the adjusted logits (mask,
        bias, penalties, min_tokens), before temperature, or in raw mode from the masked
        ones."""
        rows = [(i, req_id, params, generator) for i, req_id in enumerate(req_ids)
                for params, generator in self._sampling_rows(req_id)]
        sampled_from = logits
        if len(rows) > len(req_ids):
            logits = logits[[i for i, _, _, _ in rows]]
        params = [p for _, _, p, _ in rows]
        histories = [(self.requests[r].token_ids, self.requests[r].num_prompt_tokens) for _, r, _, _ in rows]
        masks = [(grammar_masks or {}).get(r) for _, r, _, _ in rows]
        masked = mask_tokens(logits, masks)
        adjusted = adjust(masked, params, histories, self.eos_token_ids)
        tokens = choose(adjusted, params, [g for _, _, _, g in rows])
        scored = {k: j for j, k in enumerate(k for k, p in enumerate(params) if p.logprobs is not None)}
        if scored:
            scored_from = masked if self.logprobs_mode == "raw" else adjusted
            logprobs = sampled_logprobs(scored_from[list(scored)], [tokens[k] for k in scored],
                                        [params[k].logprobs for k in scored])
        output = ModelRunnerOutput()
        for k, ((_, req_id, _, _), token) in enumerate(zip(rows, tokens)):
            if req_id not in output.sampled_token_ids:
                output.sampled_token_ids[req_id] = token
                self.requests[req_id].token_ids.append(token)
            else:
                output.fork_token_ids.setdefault(req_id, []).append(token)
            if k in scored:
                output.logprobs.setdefault(req_id, Logprobs()).append(logprobs.rows(scored[k], scored[k] + 1))
        if self.keep_logits:
            output.logits = {r: row.float() for r, row in zip(req_ids, sampled_from)}
        return output

    def _sampling_rows(self, req_id: str) -> list[tuple[SamplingParams, torch.Generator | None]]:
        """The request's row, and one per further sequence when it forks this step."""
        state = self.requests[req_id]
        rows = [(state.sampling_params, state.generator)]
        if state.sampling_params.n > 1 and len(state.token_ids) == state.num_prompt_tokens:
            for j in range(1, state.sampling_params.n):
                child = state.sampling_params.for_sequence(j)
                rows.append((child, make_generator(child.seed, self.device)))
        return rows
