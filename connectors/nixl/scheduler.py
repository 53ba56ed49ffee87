"""The NIXL connector's scheduler half: which blocks a decode server reads, which blocks
a prefill server keeps, and the `kv_transfer_params` that tie the two together.

Per request, from its `kv_transfer_params` (DESIGN.md, "PD protocol"):

- **P** (`do_remote_decode`): the request prefills and samples its first token as usual.
  When it finishes, its blocks are kept (`delay_free`) under a lease, and the response
  carries the handle D needs: engine id, side-channel host/port, request id, positional
  block ids per group (0 where P no longer holds a block), prompt length, first token,
  and the wall-clock time the lease ends (`lease_expires_at`). The worker half frees
  them when D's read-done notification arrives, when D rejects, when they are
  released (`release`: the proxy saw D fail or refuse the request), or when the lease
  expires. A read NIXL cannot stop, so D treats a read that ends after the lease as
  failed: it never decodes on blocks P may have reused. While the request waits in D's
  queue, D keeps the lease alive (`requests_waiting`: a KeepAlive at half of what it
  knows of the lease), so a long queue does not lose KV that will still be read, and a D
  that is gone lets the lease run out.
- **D** (`do_remote_prefill`): everything past D's own prefix hit arrives from P
  (`get_num_new_matched_tokens` -> (prompt - hit, async)). The hit is the full
  attention hit: Mamba and sliding-window groups are left out of the reduction for
  such requests (see KVCacheManager.get_computed_blocks). After allocation, D reads
  exactly its newly allocated positions: full attention blocks past the hit, the last
  window's blocks, and the Mamba block holding the final state; positions D holds as
  null (out of the window, behind the Mamba state) or as prefix-cache hits are not read.
- **P reading a prefix from D** (`do_remote_decode` with a `prefix`: the proxy had D
  export the KV of a prefix it holds from an earlier turn): the same read, for the
  prefix's `num_prompt_tokens` in place of the prompt (`Request.kv_source`); then P
  computes the rest. A prefix P holds already is not read (D is told to free it).

The parameters arrive typed and bounded (pd/kv_transfer/params.py). A D request whose
parameters do not fit it (wrong prompt length, block lists of the wrong shape) is not
loaded: P is told to free its blocks (a reject), `KVLoadRefused` says so to the
scheduler, and its load failure policy decides whether the request is computed here
or fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgspec

from connectors.nixl.digest_book import DigestBook
from connectors.nixl.leases import LeaseTable
from pd.contracts.connector_api import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVHeldAlready,
    KVLoadRefused,
)
from pd.contracts.request import Request, RequestStatus
from pd.kv_cache.kv_cache_manager import KVCacheBlocks
from pd.kv_cache.spec import cdiv
from pd.kv_transfer.params import PromptSources, RemotePrefillParams
from pd.kv_transfer.signing import prompt_digest, sign
from pd.logprobs import Logprobs, PromptLogprobs

KEEP_ALIVE_MARGIN = 0.1  # of a lease: how much earlier than P's lease D counts its own view to end


@dataclass(frozen=True)
class ReqToRecv:
    """Read `remote_block_ids[g][i]` into `local_block_ids[g][i]` wherever the local id
    is not 0 (0: nothing to read at that position), from where the request's PD
    parameters (`remote`, as the server decoded them) say: P's engine, side channel,
    request id and lease word. `trusted`: the parameters were signed with this
    deployment's secret, so blocks read and checked against P's lease word are P's for
    this prompt and may enter the prefix cache."""

    request_id: str
    remote: RemotePrefillParams
    local_block_ids: list[list[int]]
    remote_block_ids: list[list[int]]
    trusted: bool = False


@dataclass(frozen=True)
class ReqToSend:
    """P keeps the request's blocks for a reader until `deadline` (time.monotonic())."""

    request_id: str
    deadline: float


@dataclass
class NixlConnectorMetadata(KVConnectorMetadata):
    reqs_to_recv: list[ReqToRecv] = field(default_factory=list)
    reqs_to_send: list[ReqToSend] = field(default_factory=list)
    reqs_to_reject: list[tuple[RemotePrefillParams, str]] = field(default_factory=list)  # (where, why)
    reqs_to_release: list[str] = field(default_factory=list)  # P: kept blocks to free now
    reqs_to_keep_alive: list[RemotePrefillParams] = field(default_factory=list)  # D: still waiting to read these
    reqs_to_digest: list[tuple[str, list[list[int]]]] = field(default_factory=list)  # P: prompts complete this step


class KVTransferParamsError(ValueError):
    """A decode request's kv_transfer_params cannot be served as a remote prefill."""


class NixlConnectorScheduler(KVConnectorScheduler):
    def __init__(self, engine_id: str, host: str, side_channel_port: int, block_sizes: list[int],
                 lease_seconds: float, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, secret: str | None = None,
                 leases: LeaseTable | None = None, tp_size: int = 1, digests: DigestBook | None = None) -> None:
        if len(set(block_sizes)) != 1:
            raise ValueError(f"the NIXL connector needs one block size across KV cache groups, got {block_sizes}")
        self.engine_id = engine_id
        self.host = host
        self.side_channel_port = side_channel_port
        self.block_sizes = block_sizes
        self.lease_seconds = lease_seconds
        self.clock = clock
        self.wall_clock = wall_clock
        self.secret = secret  # signs the parameters P hands out (pd/kv_transfer/signing.py)
        self.leases = leases  # P: the worker half's lease table (None: parameters name no lease word)
        self.tp_size = tp_size  # P: its ranks hold the blocks' heads between them (D handshakes with them all)
        self.digests = digests  # P with --kv-digest: what its ranks digested of requests held for readers
        self._meta = NixlConnectorMetadata()
        self.num_rejected = 0
        self._lease_end: dict[str, float] = {}  # D: waiting request -> wall-clock end of P's lease, as known here

    # --- D side -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_source
        if params is None:
            return 0, False
        try:
            check_fits(params, request, len(self.block_sizes), self.block_sizes[0])
        except KVTransferParamsError as exc:
            self._meta.reqs_to_reject.append((params, str(exc)))  # their holder frees the blocks
            self.num_rejected += 1
            raise KVLoadRefused(request.request_id, f"its kv_transfer_params do not fit it: {exc}") from None
        if params.num_prompt_tokens <= num_computed_tokens:  # only a prefix can be
            why = f"the prefix's {params.num_prompt_tokens} tokens are held here already"
            self._meta.reqs_to_reject.append((params, why))  # the decode server frees its export
            raise KVHeldAlready(request.request_id, why)
        return params.num_prompt_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_source
        lease_end = self._lease_end.pop(request.request_id, None)
        if params is None or num_external_tokens == 0:
            return
        remote = params
        if lease_end is not None:  # kept alive while it waited
            remote = msgspec.structs.replace(remote, lease_expires_at=lease_end)
        self._meta.reqs_to_recv.append(ReqToRecv(request.request_id, remote, blocks.get_unfilled_block_ids(),
                                                 [list(ids) for ids in params.remote_block_ids],
                                                 trusted=self.secret is not None))

    def requests_waiting(self, requests: Iterable[Request]) -> None:
        """Keep P's lease alive for remote-prefill requests that wait in this queue: once
        half of what is known of the lease has passed, a KeepAlive asks P to extend it by
        its full length from when P gets it. What is known here is counted from when the
        KeepAlive was sent, less KEEP_ALIVE_MARGIN: P's extended lease ends later still."""
        now = self.wall_clock()
        for request in requests:
            params = request.kv_source
            if params is None or params.lease_seconds is None or params.lease_expires_at is None:
                continue
            end = self._lease_end.setdefault(request.request_id, params.lease_expires_at)
            if now >= end - params.lease_seconds / 2:
                self._meta.reqs_to_keep_alive.append(params)
                self._lease_end[request.request_id] = now + params.lease_seconds * (1 - KEEP_ALIVE_MARGIN)

    # --- P side -------------------------------------------------------------------
    def prompt_computed(self, request: Request, block_ids: list[list[int]]) -> None:
        if self.digests is not None and request.do_remote_decode:  # its ranks digest them after the step
            self._meta.reqs_to_digest.append((request.request_id, block_ids))

    @property
    def hands_on_after_a_step(self) -> bool:
        return self.digests is not None  # its ranks digest the KV handed on, as they do a prefill's

    def handing_on(self, request: Request, block_ids: list[list[int]], num_tokens: int) -> None:
        self._meta.reqs_to_digest.append((request.request_id, self._covering(block_ids, num_tokens)))

    def _covering(self, block_ids: list[list[int]], num_tokens: int) -> list[list[int]]:
        """Each group's blocks of the first `num_tokens` tokens."""
        return [ids[:cdiv(num_tokens, self.block_sizes[0])] for ids in block_ids]

    def request_finished(self, request: Request, block_ids: list[list[int]]) -> tuple[bool, RemotePrefillParams | None]:
        digests = self.digests.take(request.request_id) if self.digests is not None else None
        never_loaded = request.num_computed_tokens == 0
        aborted = request.status is RequestStatus.FINISHED_ABORTED
        self._lease_end.pop(request.request_id, None)
        if request.kv_source is not None and aborted and never_loaded:
            self._meta.reqs_to_reject.append((request.kv_source, "aborted before its KV was read"))
            return False, None
        if request.status is RequestStatus.FINISHED_MIGRATED:  # every token but its last, for the next server
            covered = request.num_computed_tokens
            return True, self._hold(request, self._covering(block_ids, covered), request.all_token_ids[:covered],
                                    request.output_token_ids[-1:], sources=request.client_sources, digests=digests)
        finished_well = request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
        if not request.do_remote_decode or not finished_well or not request.output_token_ids:
            return False, None
        return True, self._hold(request, block_ids, request.prompt_token_ids, request.first_token_ids,
                                request.first_logprobs, request.prompt_logprobs, request.prompt_sources, digests)

    def _hold(self, request: Request, block_ids: list[list[int]], token_ids: list[int], first_token_ids: list[int],
              first_logprobs: Logprobs | None = None, prompt_logprobs: PromptLogprobs | None = None,
              sources: dict[str, int] | None = None, digests: list[bytes] | None = None) -> RemotePrefillParams:
        """Keep the request's blocks for a reader under a lease: the parameters that name
        them, holding the KV of `token_ids` (signed when this deployment signs)."""
        slot, token = self.leases.hold(request.request_id) if self.leases is not None else (None, None)
        try:
            params = RemotePrefillParams(
                do_remote_prefill=True, remote_engine_id=self.engine_id, remote_host=self.host,
                remote_port=self.side_channel_port, remote_request_id=request.request_id,
                remote_block_ids=block_ids, num_prompt_tokens=len(token_ids),
                first_token_ids=first_token_ids, block_size=self.block_sizes[0], tp_size=self.tp_size,
                lease_expires_at=self.wall_clock() + self.lease_seconds, lease_seconds=self.lease_seconds,
                prompt_digest=prompt_digest(token_ids), lease_slot=slot, lease_token=token,
                first_logprobs=first_logprobs, prompt_logprobs=prompt_logprobs,
                prompt_sources=PromptSources.of(sources) if sources else None, kv_digests=digests)
            params = sign(params, self.secret) if self.secret else params
        except BaseException:  # the blocks are freed now: their slot must read 0 first
            if self.leases is not None:
                self.leases.release(request.request_id)
            raise
        self._meta.reqs_to_send.append(ReqToSend(request.request_id, self.clock() + self.lease_seconds))
        return params

    def release(self, request_id: str) -> None:
        self._meta.reqs_to_release.append(request_id)

    # --- every step ---------------------------------------------------------------
    def build_connector_meta(self) -> NixlConnectorMetadata:
        meta, self._meta = self._meta, NixlConnectorMetadata()
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        pass


def check_fits(params: RemotePrefillParams, request: Request, num_groups: int, block_size: int) -> None:
    """Raises KVTransferParamsError saying what of the (well-formed) parameters a request
    loads from (P's for its prompt, or a decode server's for a prefix) does not fit this
    request or this server."""
    covered = params.num_prompt_tokens
    if request.output_token_ids:  # a stream migrated with its KV: every token but the last
        if covered != request.num_tokens - 1:
            raise KVTransferParamsError(f"the migrated KV covers {covered} tokens, this request has "
                                        f"{request.num_tokens - 1} before its last")
    elif request.reads_prefix and covered >= request.num_prompt_tokens:
        raise KVTransferParamsError(f"the prefix covers {covered} tokens of a prompt of {request.num_prompt_tokens}")
    elif not request.reads_prefix and covered != request.num_prompt_tokens:
        raise KVTransferParamsError(f"the prefill covered {covered} prompt tokens, "
                                    f"this request has {request.num_prompt_tokens}")
    if params.block_size != block_size:
        raise KVTransferParamsError(f"block size {params.block_size} differs from ours ({block_size})")
    if params.kv_digests is not None and len(params.kv_digests) != params.tp_size:
        raise KVTransferParamsError(f"kv_digests has {len(params.kv_digests)} entries for {params.tp_size} ranks")
    expected = cdiv(covered, block_size)
    remote = params.remote_block_ids
    if len(remote) != num_groups or any(len(ids) != expected for ids in remote):
        raise KVTransferParamsError(f"remote_block_ids must be {num_groups} lists of {expected} block ids")
