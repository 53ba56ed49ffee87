"""Continuous batching over the KV cache manager.

Each step: running requests first (oldest first), each gets the tokens it still needs
up to the step's token budget (`max_num_batched_tokens`), so a long prompt is prefilled
in chunks; when the pool is short the newest running request is preempted (its blocks
freed, recomputed later). Then waiting requests are admitted, oldest first, with their
prefix-cache hit, while the budget, `max_num_seqs` and the pool allow; none are admitted
in a step that preempted. After the step, `update_from_output` enters the newly written
blocks in the prefix cache, appends sampled tokens and finishes requests that stop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pd.kv_cache.manager import KVCacheBlocks, KVCacheManager
from pd.outputs import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from pd.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    eos_token_ids: frozenset[int] = frozenset()


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # to tell the runner next step
        self.sent_blocks: dict[str, list[int]] = {}  # per group, block ids the runner has
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_tokens >= self.config.max_model_len:
            raise ValueError(f"prompt of {request.num_tokens} tokens leaves no room under "
                             f"max_model_len={self.config.max_model_len}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        budget = self.config.max_num_batched_tokens
        preempted = False
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            while (blocks := self.kv.allocate_slots(request, num_new)) is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                preempted = True
                if victim is request:
                    break
            if blocks is None:
                break
            self._schedule_cached(request, num_new, out)
            budget -= num_new
        if not preempted:
            self._admit_waiting(out, budget)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit, budget)
            blocks = self.kv.allocate_slots(request, num_new, num_hit, hit_blocks)
            if blocks is None:
                return
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            self.running.append(request)
            block_ids = self.kv.get_block_ids(request.request_id)
            self.sent_blocks[request.request_id] = [len(ids) for ids in block_ids]
            out.new_requests.append(NewRequestData(request.request_id, request.all_token_ids,
                                                   request.sampling_params, block_ids, num_hit))
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new

    def _schedule_cached(self, request: Request, num_new: int, out: SchedulerOutput) -> None:
        block_ids = self.kv.get_block_ids(request.request_id)
        sent = self.sent_blocks[request.request_id]
        new_ids = [ids[n:] for ids, n in zip(block_ids, sent)]
        self.sent_blocks[request.request_id] = [len(ids) for ids in block_ids]
        out.cached_requests.append(CachedRequestData(request.request_id, new_ids, request.num_computed_tokens))
        out.num_scheduled_tokens[request.request_id] = num_new

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Free the request's blocks and put it back at the front of the queue; it is
        recomputed (from its prefix-cache hit) when readmitted."""
        self.running.remove(request)
        self.kv.free(request)
        self.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.sent_blocks.pop(request.request_id, None)
        out.num_scheduled_tokens.pop(request.request_id, None)
        out.cached_requests = [c for c in out.cached_requests if c.req_id != request.request_id]
        out.finished_req_ids.add(request.request_id)
        self.waiting.appendleft(request)

    def update_from_output(self, so: SchedulerOutput, output: ModelRunnerOutput) -> list[Request]:
        """Advance the scheduled requests; returns those that finished this step."""
        finished = []
        for req_id, num_new in so.num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += num_new
            self.kv.cache_blocks(request, request.num_computed_tokens)
            token = output.sampled_token_ids.get(req_id)
            if token is None:
                continue
            request.append_output_token_ids(token)
            status = self._stop_status(request, token)
            if status is not None:
                self._finish(request, status)
                finished.append(request)
        return finished

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if (token in self.config.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.running.remove(request)
        self.kv.free(request)
        self.sent_blocks.pop(request.request_id, None)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
