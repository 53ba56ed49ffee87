"""The scheduler's part in prefill/decode disaggregation (mixed into `Scheduler`).

On P, a finished request whose blocks a decode server will read is kept in
`delayed_free` until the connector reports them sent (or released, or its lease ended);
P refuses new prefills for decode servers past `kv_max_held_fraction` of its pool held
that way. On D, a request whose prompt KV comes from P is parked in `waiting_for_remote`
(WAITING_FOR_REMOTE_KVS) with its blocks allocated until the connector reports the load
done; it then continues from P's first token of each sequence (and P's logprobs), or,
if the load failed, is computed here or fails, as the load failure policy says. A
request aborted while its blocks load is kept in `aborted_while_loading` until the load
ends. Once its remote KV has landed a request is local: a preemption recomputes it here
and never reads P again.
"""

from __future__ import annotations

import logging
from pd.errors import ERROR_KV_LOAD_FAILED
from pd.kv_transfer.params import RemotePrefillParams
from pd.scheduling.connector_api import KVConnectorOutput
from pd.scheduling.request import Request, RequestOutput, RequestStatus

logger = logging.getLogger(__name__)


class RemoteKV:
    """Methods of `Scheduler` for requests whose KV crosses servers; they use its state
    (`kv`, `connector`, `config`, the queues, `requests`) and its `_finish` / `_fail` /
    `_append_token`."""

    @property
    def num_held_blocks(self) -> int:
        """Distinct blocks kept for decode servers (finished requests under a lease)."""
        held = {b for req_id in self.delayed_free for ids in self.kv.get_block_ids(req_id) for b in ids}
        held.discard(0)  # the null block
        return len(held)

    def release_held(self, request_ids: list[str]) -> list[str]:
        """Free now the blocks kept for these finished requests (their reader will not
        come); the ids that were held."""
        held = [r for r in request_ids if r in self.delayed_free]
        for req_id in held:
            self.connector.release(req_id)
        return held

    def _park_for_remote_kv(self, request: Request, hit_blocks, num_hit: int, num_external: int) -> bool:
        """Allocate blocks for the external tokens and wait for the connector to fill them."""
        blocks = self.kv.allocate_slots(request, 0, num_hit, hit_blocks, num_external)
        if blocks is None:
            return False
        self.connector.update_state_after_alloc(request, self.kv.get_blocks(request.request_id), num_external)
        self.waiting.popleft()
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_hit + num_external
        request.num_cached_tokens = num_hit
        self.waiting_for_remote[request.request_id] = request
        return True

    def _update_connector(self, connector_output: KVConnectorOutput) -> list[RequestOutput]:
        """Free blocks the connector finished sending; requeue requests whose remote KV
        landed (or failed to: the load failure policy decides). Returns the outputs of
        requests that continue from a remote prefill's first token."""
        self.connector.update_connector_output(connector_output)
        outputs = []
        for req_id in connector_output.finished_sending:
            request = self.delayed_free.pop(req_id, None)
            if request is not None:
                self.kv.free(request)
        for req_id in [*connector_output.finished_recving, *connector_output.failed_recving]:
            aborted = self.aborted_while_loading.pop(req_id, None)
            if aborted is not None:
                self.kv.free(aborted)
            request = self.waiting_for_remote.pop(req_id, None)
            if request is None:
                continue
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
            if req_id in connector_output.failed_recving:
                request.kv_load_error = connector_output.failed_recving[req_id]
                if not self._fails_on_load_error(request):  # computed here from scratch
                    self.kv.free(request)
                    request.num_computed_tokens = 0
                continue
            if req_id in connector_output.unverified:  # it may use this KV; nobody else may hit it
                request.writes_prefix_cache = False
            self.kv.cache_blocks(request, request.num_computed_tokens)
            outputs += self._continue_from_first_token(request)
            request.kv_transfer_params = None  # a local request from now on (P frees its blocks)
        return outputs

    def _fails_on_load_error(self, request: Request) -> bool:
        """A waiting request (at the queue's front) whose remote KV could not be loaded:
        under "recompute" it stays queued and is computed here; under "fail" it finishes
        with an error output (queued for the next update). True if it failed."""
        policy = self.config.kv_load_failure_policy
        self.kv_load_failures[policy] += 1
        if policy == "recompute":
            return False
        self._fail(request, ERROR_KV_LOAD_FAILED, "the KV cache of this request could not be loaded from the "
                                                  f"prefill server: {request.kv_load_error}")
        return True

    def _continue_from_first_token(self, request: Request) -> list[RequestOutput]:
        """A remote prefill sampled the first token of each sequence (and scored it and
        the prompt, if asked): they become this request's first outputs (nothing is
        recomputed), and may already finish it."""
        remote = request.remote_prefill
        if remote is None or request.output_token_ids:
            return []
        if request.prompt_logprobs is not None:
            request.prompt_logprobs = remote.prompt_logprobs
        return self._append_token(request, list(remote.first_token_ids), remote.first_logprobs)

    def _connector_finished(self, request: Request) -> tuple[bool, RemotePrefillParams | None]:
        """The connector's `request_finished`; a fault there keeps nothing for anyone."""
        try:
            return self.connector.request_finished(request, self.kv.get_block_ids(request.request_id))
        except Exception:
            logger.exception("the connector failed finishing request %s; its blocks are freed", request.request_id)
            return False, None
