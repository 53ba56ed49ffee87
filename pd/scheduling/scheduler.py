"""Continuous batching over the KV cache manager, with the connector at fixed points.

Each step: running requests first (oldest first), each gets the tokens it still needs
up to the step's token budget (`max_num_batched_tokens`), so a long prompt is prefilled
in chunks; while sequences are decoding, the step's prompt tokens are bounded further so
that the step stays within `--max-step-ms` (step_budget.py), every decode still going;
when the pool is short a running sequence is preempted (its blocks freed,
recomputed later). Then waiting requests are admitted with their prefix-cache hit plus
whatever the connector can load, while the budget, `max_num_seqs` and the pool allow (one
whose prompt shares blocks with a running request's that are still to be computed waits
until they are cached);
none are admitted in a step that preempted for growth. Which request is admitted first
and which sequence is preempted follow `fair_share.py`: the batch is shared max-min
fairly between requests, so that one request's n sequences cannot starve the others. A
request whose KV arrives asynchronously is parked until the connector reports it
received (`RemoteKV`, remote_kv.py, is the scheduler's part in PD). A request with a
grammar waits for it to compile first (WAITING_FOR_GRAMMAR); the masks of its next
tokens go out with each step that samples it. After the step, `update_from_output`
enters the newly written blocks in the prefix cache, appends sampled tokens and finishes
requests that stop. A request asking
for n sequences forks at its first token into requests of its own that share its blocks
copy on write (the copies of the blocks they do not share go out with the next step).

With Mamba groups, prefill chunks end on block boundaries when the budget allows, so a
chunk's last state is a boundary state (a request whose prompt KV comes from a remote
prefill is exempt). Correctness does not depend on it: the runner writes every boundary
state a chunk crosses.

An exception admitting a request, or a batch the runner reports failed, ends those
requests with an error and frees their blocks; the others go on.
"""

from __future__ import annotations

import logging
import time

from pd.config import SchedulerConfig
from pd.contracts.connector_api import KVConnectorScheduler, KVHeldAlready, KVLoadRefused
from pd.contracts.outputs import ModelRunnerOutput, SchedulerOutput
from pd.contracts.request import Request, RequestOutput, RequestStatus, sequence_id
from pd.kv_cache.kv_cache_manager import KVCacheManager
from pd.kv_transfer.params import RemotePrefillParams
from pd.logprobs import Logprobs
from pd.scheduling import fair_share
from pd.scheduling.prefix_wait import PrefixesComputing
from pd.scheduling.prompt_sources import PromptSources
from pd.scheduling.remote_kv import RemoteKV
from pd.scheduling.runner_view import RunnerView
from pd.scheduling.step_budget import StepBudget
from pd.scheduling.tokens import chunk_tokens, off_grammar, samples, stop_status
from pd.scheduling.waiting import WaitingQueue
from pd.structured.matchers import GrammarMatchers
from wire.codes import INTERNAL_ERROR, INVALID_REQUEST, KV_LOAD_FAILED

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 connector: KVConnectorScheduler, grammars: GrammarMatchers | None = None) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.connector = connector  # NullConnectorScheduler when serving alone
        self.grammars = grammars or GrammarMatchers(None, config.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(self.grammars)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # to tell the runner next step
        self.runner_view = RunnerView(kv_cache_manager)
        self.step_budget = StepBudget(config.settings.max_num_batched_tokens, config.settings.max_step_ms)
        self._hash_block_size = min(kv_cache_manager.config.block_sizes)  # prefix_wait's blocks
        self.remote_kv = RemoteKV(kv_cache_manager, connector, config.settings.kv_load_failure_policy,
                                  config.settings.kv_max_held_fraction)
        self.num_preemptions = 0
        self.num_steps = 0  # schedule() calls
        self._failed_outputs: list[RequestOutput] = []  # failed between updates; sent with the next one
        self.prompt_sources = PromptSources()
        self.block_copies: list[tuple[int, int]] = []  # of forked sequences, for the next step
        self.to_migrate: set[str] = set()  # client request ids whose sequences are handed on (`migrate`)
        self._handing_on: set[str] = set()  # sequences of those the last step computed for the connector

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self.remote_kv.delayed_free:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_tokens >= self.config.max_model_len:
            raise ValueError(f"prompt of {request.num_tokens} tokens leaves no room under "
                             f"max_model_len={self.config.max_model_len}")
        self.remote_kv.check_room_to_hold(request)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.waiting.for_grammar) + len(self.remote_kv.waiting)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.waiting.for_grammar or self.remote_kv.waiting)

    @property
    def has_compute_work(self) -> bool:
        """Requests to compute (not only waiting for remote KV or holding blocks for one)."""
        return bool(self.waiting or self.running)

    @property
    def has_work(self) -> bool:
        """Requests to step, or blocks still kept for the connector."""
        return self.has_unfinished_requests or self.remote_kv.has_blocks_kept or self.connector.has_work

    def schedule(self) -> SchedulerOutput:
        for request, error in self.waiting.compiled():
            self._fail(request, INVALID_REQUEST, error)
        out = SchedulerOutput(finished_req_ids=self.finished_req_ids, block_copies=self.block_copies)
        self.finished_req_ids, self.block_copies = set(), []
        budget = self.config.settings.max_num_batched_tokens
        prompt_budget = self.step_budget.for_step((r.num_tokens_to_compute for r in self.running), len(self.waiting),
                                                  self.config.settings.max_num_seqs)
        preempted = False
        self.num_steps += 1
        share = fair_share.step_share(self.running, self.waiting)
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or budget <= 0 or request.request_id not in share:
                continue  # preempted earlier in this loop, no budget left, or past its request's share
            decoding = request.num_tokens_to_compute == 1
            if not decoding and prompt_budget <= 0:
                continue  # the decodes after it still go
            limit = budget if decoding else min(budget, prompt_budget)
            num_new = chunk_tokens(request, request.num_computed_tokens, limit, self.config.mamba_block_size)
            while (blocks := self.kv.allocate_slots(request, num_new)) is None:
                victim = fair_share.growth_victim(self.running, fair_share.running_counts(self.running))
                self._preempt(victim, out)
                preempted = True
                if victim is request:
                    break
            if blocks is None:
                break
            self.runner_view.schedule(request, num_new, out)  # a sequence forked since the last step: whole
            request.last_step = self.num_steps
            budget -= num_new
            prompt_budget -= 0 if decoding else num_new
        if not preempted:
            self._admit_waiting(out, min(budget, prompt_budget))
        self.step_budget.planned(out.num_scheduled_tokens.values())
        self._handing_on = set()
        for req_id, num_new in out.num_scheduled_tokens.items():
            request = self.requests[req_id]
            if request.num_computed_tokens < request.num_prompt_tokens <= request.num_computed_tokens + num_new:
                self.connector.prompt_computed(request, self.kv.get_block_ids(req_id))
            if request.output_id in self.to_migrate and self.connector.hands_on_after_a_step:
                self.connector.handing_on(request, self.kv.get_block_ids(req_id), request.num_computed_tokens + num_new)
                self._handing_on.add(req_id)
        self.connector.requests_waiting(self.waiting)
        out.kv_connector_metadata = self.connector.build_connector_meta()
        out.grammar_masks = self.grammars.masks([r for r, n in out.num_scheduled_tokens.items() if r in self.grammars
                                                 and samples(self.requests[r], n)])
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests, fairest first, while the budget lasts and the batch and
        the pool have room, or can be made room in by preempting a request past its
        fair share (fair_share.py); those that wait for a prefix being computed
        (prefix_wait.py) keep their turn."""
        if not self.waiting:
            return
        computing = PrefixesComputing(self.running, self._hash_block_size, self.kv.enable_caching)
        while budget > 0:
            request = computing.first_free(fair_share.in_turn(self.waiting, fair_share.running_counts(self.running)))
            if request is None:
                return
            if len(self.running) >= self.config.settings.max_num_seqs and not self._displace_for(request, out):
                return
            try:
                scheduled = self._admit(request, out, budget)
            except Exception as exc:  # a fault serving one request fails that request alone
                logger.exception("admitting request %s failed", request.request_id)
                self._fail(request, INTERNAL_ERROR,
                           f"internal error admitting the request: {type(exc).__name__}: {exc}")
                continue
            if scheduled is None:
                self.waiting.to_front(request)  # it keeps its turn
                if self._displace_for(request, out):
                    continue  # its blocks may be enough now
                return
            budget -= scheduled
            if request.status is RequestStatus.RUNNING:
                computing.add(request)

    def _displace_for(self, request: Request, out: SchedulerOutput) -> bool:
        """Preempt a sequence of a request past its fair share so that `request` can run;
        whether one was."""
        victim = fair_share.displaced_for(request, self.running, fair_share.running_counts(self.running))
        if victim is None:
            return False
        self._preempt(victim, out)
        return True

    def _admit(self, request: Request, out: SchedulerOutput, budget: int) -> int | None:
        """Admit the waiting request: the tokens scheduled for it (0 if it was parked for
        remote KV or failed), or None when the pool cannot take it."""
        if request.num_computed_tokens == 0:  # new or preempted: look up what exists
            hit_blocks, num_hit = self.kv.get_computed_blocks(request, self._skipped_groups(request))
            try:
                num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_hit)
            except KVHeldAlready as held:  # a prefix held here: nothing to read, no failure
                self.remote_kv.skip_read(request, held.reason)
                hit_blocks, num_hit = self.kv.get_computed_blocks(request)  # every group's hit now
                num_external, load_async = 0, False
            except KVLoadRefused as refused:  # its remote KV cannot be loaded: a local request now
                request.kv_load_error = refused.reason
                if self._fails_on_load_error(request):
                    return 0
                # the hit above skipped Mamba / sliding-window groups for a remote prefill
                hit_blocks, num_hit = self.kv.get_computed_blocks(request)
                num_external, load_async = 0, False
        else:  # its remote KV has landed; its blocks are already allocated
            hit_blocks, num_hit, num_external, load_async = None, 0, 0, False
        if load_async:
            if not self._room_to_grow(request, num_hit + num_external, self.kv.num_blocks_to_allocate(
                    request, 0, num_hit, hit_blocks, num_external)):
                return None
            if not self.remote_kv.park(request, hit_blocks, num_hit, num_external):
                return None
            self.waiting.discard(request)
            return 0
        computed = request.num_computed_tokens + num_hit + num_external
        num_new = chunk_tokens(request, computed, budget, self.config.mamba_block_size)
        if hit_blocks is not None and not self._room_to_grow(
                request, computed + num_new, self.kv.num_blocks_to_allocate(request, num_new, num_hit, hit_blocks,
                                                                            num_external)):
            return None
        blocks = self.kv.allocate_slots(request, num_new, num_hit, hit_blocks, num_external)
        if blocks is None:
            return None
        if num_external:
            self.connector.update_state_after_alloc(request, self.kv.get_blocks(request.request_id), num_external)
        self.waiting.discard(request)
        self.prompt_sources.count(request, num_hit, num_external)
        self._start_running(request, computed, num_hit, num_new, out)
        return num_new

    def _room_to_grow(self, request: Request, num_tokens_held: int, num_blocks_now: int) -> bool:
        """Rule 4 of fair_share.py, for `request` about to take `num_blocks_now` blocks to
        hold `num_tokens_held` tokens."""
        return fair_share.room_to_grow(self.kv, [*self.running, *self.remote_kv.waiting.values()], request,
                                       num_tokens_held, num_blocks_now, self.config.settings.reserve_growth_tokens,
                                       self.config.max_model_len)

    def _skipped_groups(self, request: Request) -> frozenset[int]:
        """The KV cache groups left out of the request's prefix-cache hit search: for a
        remote prefill (or a prefix read from D), the groups keeping part of a prefix
        (the read brings what they need)."""
        if request.kv_source is not None and self.config.settings.skip_partial_groups_on_remote_prefill:
            return self.kv.partial_prefix_groups
        return frozenset()

    def _start_running(self, request: Request, computed: int, num_hit: int, num_new: int,
                       out: SchedulerOutput) -> None:
        if request.status is not RequestStatus.WAITING_FOR_REMOTE_KVS:
            request.num_cached_tokens = num_hit
        request.status = RequestStatus.RUNNING
        request.times.scheduled = request.times.scheduled or time.time()
        request.num_computed_tokens = computed
        request.last_step = self.num_steps
        self.running.append(request)
        self.runner_view.schedule(request, num_new, out)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Free the request's blocks and put it back at the front of the queue; it is
        recomputed (from its prefix-cache hit) when readmitted."""
        self.running.remove(request)
        self.kv.free(request)
        self.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.runner_view.forget(request.request_id)
        out.drop(request.request_id)
        self.waiting.put_front(request)

    def update_from_output(self, so: SchedulerOutput, output: ModelRunnerOutput) -> list[RequestOutput]:
        """Advance the scheduled requests; one RequestOutput per request that got a token
        or finished this step (those marked to be handed on, once ready: `migrate`)."""
        outputs = []
        for req_id, why in output.failed.items():
            if (request := self.requests.get(req_id)) is not None:
                self._fail(request, INTERNAL_ERROR, f"internal error computing the request: {why}")
        for req_id, num_new in so.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted (or failed) while its step ran
            request.num_computed_tokens += num_new
            self.kv.cache_blocks(request, request.num_computed_tokens)
            if req_id in output.prompt_logprobs:
                request.add_prompt_logprobs(output.prompt_logprobs[req_id])
            token = output.sampled_token_ids.get(req_id)
            if token is None:
                continue
            outputs += self._append_token(request, [token, *output.fork_token_ids.get(req_id, ())],
                                          output.logprobs.get(req_id))
        outputs += self._update_connector(output)
        outputs += self._failed_outputs
        self._failed_outputs = []
        return outputs + self.migrated()

    def _update_connector(self, output: ModelRunnerOutput) -> list[RequestOutput]:
        """Requests whose remote KV landed rejoin the queue's front and continue from the
        remote prefill's first tokens; those whose load failed are computed here or fail,
        as the load failure policy says. Their outputs."""
        outputs = []
        for request in self.remote_kv.update(output.kv_connector_output):
            self.waiting.put_front(request)
            if request.kv_load_error is not None:
                if not self._fails_on_load_error(request):  # computed here from scratch
                    self.kv.free(request)
                    request.num_computed_tokens = 0
                continue
            first = RemoteKV.first_tokens(request)
            request.remote_kv_landed()  # its holder frees the blocks; sequences forked below inherit what P said
            if first is not None:
                outputs += self._append_token(request, *first)
        return outputs

    def _fails_on_load_error(self, request: Request) -> bool:
        """A waiting request (at the queue's front) whose remote KV could not be loaded
        stays queued and is computed here, or finishes with an error output (queued for
        the next update), as the load failure policy says. True if it failed."""
        if (error := self.remote_kv.load_fails(request)) is None:
            return False
        self._fail(request, KV_LOAD_FAILED, error)
        return True

    def _append_token(self, request: Request, tokens: list[int], logprobs: Logprobs | None) -> list[RequestOutput]:
        """The request's new token `tokens[0]` (with its logprobs), and its output; more
        tokens are the first of the sequences it forks into. It finishes if its token
        stops it. The prompt's logprobs go out once, with the first token."""
        rows = logprobs.rows(0, 1) if logprobs is not None else None
        for index in range(1, len(tokens)):  # each sequence's matcher from the state before token 1
            self.grammars.fork(request.request_id, sequence_id(request.request_id, index))
        request.append_output_token_ids(tokens[0])
        request.add_output_logprobs(rows)
        forked = self._fork(request, tokens[1:], logprobs.rows(1) if logprobs is not None else None) \
            if len(tokens) > 1 else []
        if not self.grammars.accept(request.request_id, tokens[0]):  # a first token from elsewhere
            self._fail(request, INVALID_REQUEST, off_grammar(tokens[0]))
            return forked
        status = self._stop_status(request, tokens[0])
        params = self._finish(request, status) if status is not None else None
        scored = request.prompt_logprobs if len(request.output_token_ids) == 1 else None
        return [RequestOutput.of(request, tokens[:1], status, params, rows, scored), *forked]

    def _fork(self, parent: Request, tokens: list[int], logprobs: Logprobs | None) -> list[RequestOutput]:
        """Sequences 1.. of `parent`, each from its first token: they share the parent's
        computed blocks (copy on write) and run, or, when the batch or the pool is full,
        wait to be recomputed from the prefix cache; one that its first token already
        stops holds nothing. Their outputs."""
        parent.fork_token_ids, parent.fork_logprobs = list(tokens), logprobs
        outputs = []
        for index, token in enumerate(tokens, start=1):
            rows = logprobs.rows(index - 1, index) if logprobs is not None else None
            child = parent.fork(index, token, rows)
            if not self.grammars.accept(child.request_id, token):
                self.grammars.remove(child.request_id)
                outputs.append(RequestOutput(child.output_id, [], "error", error=off_grammar(token),
                                             error_code=INVALID_REQUEST, index=index))
                continue
            status = self._stop_status(child, token)
            if status is None:
                self._place_fork(parent, child)
            else:
                child.status = status
                self.grammars.remove(child.request_id)
            outputs.append(RequestOutput.of(child, [token], status, logprobs=rows))
        return outputs

    def _place_fork(self, parent: Request, child: Request) -> None:
        self.requests[child.request_id] = child
        copies = self.kv.fork(parent, child) if len(self.running) < self.config.settings.max_num_seqs else None
        if copies is None:
            child.status = RequestStatus.PREEMPTED
            self.waiting.put_front(child)
            return
        child.status = RequestStatus.RUNNING
        child.num_computed_tokens = parent.num_computed_tokens
        self.running.append(child)
        self.block_copies += copies

    def _fail(self, request: Request, code: str, message: str) -> None:
        """End the request wherever it is with finish_reason "error" (its output goes
        out with the next update); its blocks are freed as for any finished request."""
        self._finish(request, RequestStatus.FINISHED_ERROR)
        self._failed_outputs.append(RequestOutput(request.output_id, [], "error", error=message, error_code=code,
                                                  index=request.index))

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        return stop_status(request, token, self.config.eos_token_ids, self.config.max_model_len,
                           self.grammars.is_stopped(request.request_id))

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Finish the requests as aborted wherever they are; unknown ids are ignored."""
        outputs = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            params = self._finish(request, RequestStatus.FINISHED_ABORTED)
            outputs.append(RequestOutput.of(request, [], RequestStatus.FINISHED_ABORTED, params))
        return outputs

    def migrate(self, request_ids: list[str]) -> list[RequestOutput]:
        """Hand these client requests on (a draining server): each of their sequences is
        paused at a step boundary once its KV holds every token but its last (it has
        sampled a token and computed the others) and finishes as migrated, its blocks kept
        for the server that goes on with it where the connector keeps them (its output's
        kv_transfer_params). Those ready now are migrated now; the others after the step
        that makes them so (`migrated`). The outputs of those migrated now."""
        self.to_migrate.update(r for r in request_ids if any(q.output_id == r for q in self.requests.values()))
        return self.migrated()

    def migrated(self) -> list[RequestOutput]:
        """Migrate the sequences marked (`migrate`) that are ready; their outputs. Where
        the connector acts on their KV after a step (`handing_on`: it digests it), only
        once a step has run since they were marked."""
        if not self.to_migrate:
            return []
        outputs = []
        for request in list(self.requests.values()):
            ready = request.status in (RequestStatus.RUNNING, RequestStatus.WAITING) and request.output_token_ids \
                and request.num_computed_tokens == request.num_tokens - 1 \
                and (request.request_id in self._handing_on or not self.connector.hands_on_after_a_step)
            if request.output_id in self.to_migrate and ready:
                params = self._finish(request, RequestStatus.FINISHED_MIGRATED)
                outputs.append(RequestOutput.of(request, [], RequestStatus.FINISHED_MIGRATED, params))
        self.to_migrate &= {request.output_id for request in self.requests.values()}
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> RemotePrefillParams | None:
        """End the request wherever it is; its blocks are freed now or, if the connector
        keeps them, when it reports them sent. Returns the connector's kv_transfer_params."""
        previous, request.status = request.status, status
        was_loading = previous is RequestStatus.WAITING_FOR_REMOTE_KVS
        if previous is RequestStatus.RUNNING:
            self.running.remove(request)
            self.finished_req_ids.add(request.request_id)
        elif previous in (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.WAITING_FOR_GRAMMAR):
            self.waiting.discard(request)
        self.grammars.remove(request.request_id)
        self.runner_view.forget(request.request_id)
        self.prompt_sources.forget(request.request_id)
        del self.requests[request.request_id]
        return self.remote_kv.finish(request, was_loading)
