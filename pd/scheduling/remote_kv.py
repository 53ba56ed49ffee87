"""The scheduler's part in prefill/decode disaggregation: a component `Scheduler` owns,
with the queues and counts of requests whose KV crosses servers.

On P, a finished request whose blocks a decode server will read is kept in
`delayed_free` until the connector reports them sent (or released, or its lease ended);
P refuses new prefills for decode servers past `kv_max_held_fraction` of its pool held
that way. On D, a request whose prompt KV comes from P is parked in `waiting`
(WAITING_FOR_REMOTE_KVS) with its blocks allocated until the connector reports the load
done; the scheduler then continues it from P's first token of each sequence (and P's
logprobs), or, if the load failed, computes it here or fails it, as the load failure
policy says. On P, a request reading a prefix from a decode server (`Request.kv_source`)
is parked the same way, then computes the rest of its prompt; a prefix it could not read
it computes, whatever the policy. A request aborted while its blocks load is kept in
`aborted_while_loading` until the load ends. Once its remote KV has landed a request is
local: a preemption recomputes it here and never reads P again.
"""

from __future__ import annotations

import logging
import time

from pd.contracts.connector_api import KVConnectorOutput, KVConnectorScheduler
from pd.contracts.request import Request, RequestStatus
from pd.errors import HeldBlocksLimitError
from pd.kv_cache.kv_cache_manager import KVCacheBlocks, KVCacheManager
from pd.kv_transfer.params import RemotePrefillParams
from pd.logprobs import Logprobs

logger = logging.getLogger(__name__)

REMOTE = "remote"  # `Request.kv_loaded_from` of KV read from another server


class RemoteKV:
    def __init__(self, kv: KVCacheManager, connector: KVConnectorScheduler, load_failure_policy: str,
                 max_held_fraction: float) -> None:
        self.kv = kv
        self.connector = connector
        self.load_failure_policy = load_failure_policy  # "recompute" or "fail"
        self.max_held_fraction = max_held_fraction
        self.waiting: dict[str, Request] = {}  # D: blocks allocated, the connector fills them
        self.delayed_free: dict[str, Request] = {}  # P: finished, blocks kept for the connector
        self.aborted_while_loading: dict[str, Request] = {}  # D: blocks freed once the load ends
        self.load_failures = {"recompute": 0, "fail": 0}  # by what was done about them
        self.reads_skipped = 0  # P: prefixes a decode server exported that this server held already

    @property
    def num_held_blocks(self) -> int:
        """Distinct blocks kept for decode servers (finished requests under a lease)."""
        held = {b for req_id in self.delayed_free for ids in self.kv.get_block_ids(req_id) for b in ids}
        held.discard(0)  # the null block
        return len(held)

    @property
    def has_blocks_kept(self) -> bool:
        """Blocks of finished requests still kept for the connector."""
        return bool(self.delayed_free or self.aborted_while_loading)

    def check_room_to_hold(self, request: Request) -> None:
        """HeldBlocksLimitError for a prefill for a decode server when this server
        already keeps its share of blocks for decode servers."""
        if not request.do_remote_decode:
            return
        held, usable = self.num_held_blocks, self.kv.num_usable_blocks
        if held >= self.max_held_fraction * usable:
            raise HeldBlocksLimitError(f"this prefill server keeps {held} of its {usable} KV blocks for "
                                       "decode servers that have not read them yet; retry later")

    def release_held(self, request_ids: list[str]) -> list[str]:
        """Free now the blocks kept for these finished requests (their reader will not
        come); the ids that were held."""
        held = [r for r in request_ids if r in self.delayed_free]
        for req_id in held:
            self.connector.release(req_id)
        return held

    def park(self, request: Request, hit_blocks: KVCacheBlocks, num_hit: int, num_external: int) -> bool:
        """Allocate blocks for the external tokens and wait for the connector to fill
        them; False when the pool cannot take them (nothing changed)."""
        blocks = self.kv.allocate_slots(request, 0, num_hit, hit_blocks, num_external)
        if blocks is None:
            return False
        self.connector.update_state_after_alloc(request, self.kv.get_blocks(request.request_id), num_external)
        request.kv_loaded_from = request.kv_loaded_from or REMOTE  # an offload tier names itself
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.times.kv_wait, request.times.kv_tokens = time.time(), num_external
        request.num_computed_tokens = num_hit + num_external
        request.num_cached_tokens = num_hit
        self.waiting[request.request_id] = request
        return True

    def update(self, connector_output: KVConnectorOutput) -> list[Request]:
        """Free blocks the connector finished sending; hand back, as WAITING requests in
        the order the connector reported them, those whose remote KV landed (their
        blocks enter the prefix cache) or failed to (their `kv_load_error` says why)."""
        self.connector.update_connector_output(connector_output)
        for req_id in connector_output.finished_sending:
            request = self.delayed_free.pop(req_id, None)
            if request is not None:
                self.kv.free(request)
        landed = []
        for req_id in [*connector_output.finished_recving, *connector_output.failed_recving]:
            aborted = self.aborted_while_loading.pop(req_id, None)
            if aborted is not None:
                self.kv.free(aborted)
            request = self.waiting.pop(req_id, None)
            if request is None:
                continue
            request.status = RequestStatus.WAITING
            request.times.kv_landed = time.time()
            request.times.kv_bytes, request.times.kv_descriptors = connector_output.load_sizes.get(req_id, (None, None))
            landed.append(request)
            if req_id in connector_output.failed_recving:
                request.kv_load_error = request.times.kv_error = connector_output.failed_recving[req_id]
                continue
            if req_id in connector_output.unverified:  # it may use this KV; nobody else may hit it
                request.writes_prefix_cache = False
            self.kv.cache_blocks(request, request.num_computed_tokens)
        return landed

    def skip_read(self, request: Request, why: str) -> None:
        """P holds the prefix a decode server exported for `request`: it reads nothing
        (counted, logged) and goes on as a request keeping its blocks for that server."""
        self.reads_skipped += 1
        logger.info("request %s reads no prefix from the decode server: %s", request.request_id, why)
        request.remote_kv_landed()

    def load_fails(self, request: Request) -> str | None:
        """Count and log a request whose remote KV could not be loaded (`kv_load_error`):
        the error to end it with when the policy is "fail", None when it is "recompute"
        (it is computed here), as a prefix P could not read from D, or blocks an offload
        tier could not give back, always are."""
        from_tier = request.kv_loaded_from not in (None, REMOTE)  # a lower tier's copy: a miss, never an error
        policy = "recompute" if request.reads_prefix or from_tier else self.load_failure_policy
        self.load_failures[policy] += 1
        if from_tier:
            source = f"the {request.kv_loaded_from} tier"
        else:
            source = "a decode server" if request.reads_prefix else "the prefill server"
        logger.warning("request %s: its KV could not be loaded from %s (%s); %s", request.request_id, source,
                       request.kv_load_error, "computed here" if policy == "recompute" else "failed")
        if policy == "recompute":
            return None
        return f"the KV cache of this request could not be loaded from the prefill server: {request.kv_load_error}"

    @staticmethod
    def first_tokens(request: Request) -> tuple[list[int], Logprobs | None] | None:
        """The first token of each sequence a remote prefill sampled (and their
        logprobs), to become the request's first outputs (nothing is recomputed); None
        when it has none or has outputs already. The prompt's logprobs, if asked for,
        are P's."""
        remote = request.remote_prefill
        if remote is None or request.output_token_ids:
            return None
        if request.prompt_logprobs is not None:
            request.prompt_logprobs = remote.prompt_logprobs
        return list(remote.first_token_ids), remote.first_logprobs

    def finish(self, request: Request, was_loading: bool) -> RemotePrefillParams | None:
        """A request ends: the connector's `request_finished` says whether its blocks are
        kept for a reader; blocks still being written wait for the load to end. Frees the
        blocks otherwise. Returns the connector's kv_transfer_params."""
        self.waiting.pop(request.request_id, None)
        try:
            delay_free, params = self.connector.request_finished(request, self.kv.get_block_ids(request.request_id))
        except Exception:  # a fault there keeps nothing for anyone
            logger.exception("the connector failed finishing request %s; its blocks are freed", request.request_id)
            delay_free, params = False, None
        if was_loading:  # the connector may still be writing its blocks
            self.aborted_while_loading[request.request_id] = request
        elif delay_free:
            self.delayed_free[request.request_id] = request
        else:
            self.kv.free(request)
        return params
