"""The NIXL connector's scheduler half: which blocks a decode server reads, which blocks
a prefill server keeps, and the `kv_transfer_params` that tie the two together.

Per request, from its `kv_transfer_params` (DESIGN.md, "PD protocol"):

- **P** (`do_remote_decode`): the request prefills and samples its first token as usual.
  When it finishes, its blocks are kept (`delay_free`) under a lease, and the response
  carries the handle D needs: engine id, side-channel host/port, request id, positional
  block ids per group (0 where P no longer holds a block), prompt length, first token,
  and the wall-clock time the lease ends (`lease_expires_at`). The worker half frees
  them when D's read-done notification arrives, when D rejects, or when the lease
  expires. A read NIXL cannot stop, so D treats a read that ends after the lease as
  failed: it never decodes on blocks P may have reused.
- **D** (`do_remote_prefill`): everything past D's own prefix hit arrives from P
  (`get_num_new_matched_tokens` -> (prompt - hit, async)). The hit is the full
  attention hit: Mamba and sliding-window groups are left out of the reduction for
  such requests (see KVCacheManager.get_computed_blocks). After allocation, D reads
  exactly its newly allocated positions: full attention blocks past the hit, the last
  window's blocks, and the Mamba block holding the final state; positions D holds as
  null (out of the window, behind the Mamba state) or as prefix-cache hits are not read.

A D request whose parameters do not fit (wrong prompt length, block lists of the wrong
shape) is not loaded: P is told to free its blocks (a reject), and the scheduler's load
failure policy decides whether the request is computed here or fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from connectors.base import KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler
from pd.kv_cache.spec import cdiv
from pd.request import Request, RequestStatus

REQUIRED_D_PARAMS = ("remote_engine_id", "remote_host", "remote_port", "remote_request_id",
                     "remote_block_ids", "num_prompt_tokens")


@dataclass(frozen=True)
class RemotePrefill:
    """Where a D request's KV lives on P."""

    engine_id: str
    host: str
    port: int
    request_id: str
    lease_expires_at: float | None = None  # wall clock; a read ending later is a failure


@dataclass(frozen=True)
class ReqToRecv:
    """Read `remote_block_ids[g][i]` into `local_block_ids[g][i]` wherever the local id
    is not 0 (0: nothing to read at that position)."""

    request_id: str
    remote: RemotePrefill
    local_block_ids: list[list[int]]
    remote_block_ids: list[list[int]]


@dataclass(frozen=True)
class ReqToSend:
    """P keeps the request's blocks for a reader until `deadline` (time.monotonic())."""

    request_id: str
    deadline: float


@dataclass
class NixlConnectorMetadata(KVConnectorMetadata):
    reqs_to_recv: list[ReqToRecv] = field(default_factory=list)
    reqs_to_send: list[ReqToSend] = field(default_factory=list)
    reqs_to_reject: list[tuple[RemotePrefill, str]] = field(default_factory=list)  # (where, why)


class KVTransferParamsError(ValueError):
    """A decode request's kv_transfer_params cannot be served as a remote prefill."""


class NixlConnectorScheduler(KVConnectorScheduler):
    def __init__(self, engine_id: str, host: str, side_channel_port: int, block_sizes: list[int],
                 lease_seconds: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        if len(set(block_sizes)) != 1:
            raise ValueError(f"the NIXL connector needs one block size across KV cache groups, got {block_sizes}")
        self.engine_id = engine_id
        self.host = host
        self.side_channel_port = side_channel_port
        self.block_sizes = block_sizes
        self.lease_seconds = lease_seconds
        self.clock = clock
        self.wall_clock = wall_clock
        self._meta = NixlConnectorMetadata()
        self.num_rejected = 0

    # --- D side -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if not request.do_remote_prefill:
            return 0, False
        try:
            remote_prefill_params(request, len(self.block_sizes), self.block_sizes[0])
        except KVTransferParamsError as exc:
            self._reject_invalid(request, str(exc))
            return 0, False
        return request.num_prompt_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        if not request.do_remote_prefill or num_external_tokens == 0:
            return
        params = request.kv_transfer_params
        self._meta.reqs_to_recv.append(ReqToRecv(request.request_id, remote_of(params), blocks.get_unfilled_block_ids(),
                                                 [list(ids) for ids in params["remote_block_ids"]]))

    def _reject_invalid(self, request: Request, reason: str) -> None:
        """Compute the request here; tell P (if it can be reached) to free its blocks."""
        request.kv_load_error = f"its kv_transfer_params cannot be loaded here: {reason}"
        params = request.kv_transfer_params or {}
        if all(k in params for k in ("remote_engine_id", "remote_host", "remote_port", "remote_request_id")):
            self._meta.reqs_to_reject.append((remote_of(params), reason))
        self.num_rejected += 1

    # --- P side -------------------------------------------------------------------
    def request_finished(self, request: Request, block_ids: list[list[int]]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        never_loaded = request.num_computed_tokens == 0
        if request.do_remote_prefill and request.status is RequestStatus.FINISHED_ABORTED and never_loaded:
            self._meta.reqs_to_reject.append((remote_of(params), "aborted on the decode server"))
            return False, None
        if not params.get("do_remote_decode") or request.status is RequestStatus.FINISHED_ABORTED:
            return False, None
        if not request.output_token_ids:
            return False, None
        self._meta.reqs_to_send.append(ReqToSend(request.request_id, self.clock() + self.lease_seconds))
        return True, {
            "do_remote_prefill": True,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.side_channel_port,
            "remote_request_id": request.request_id,
            "remote_block_ids": block_ids,
            "num_prompt_tokens": request.num_prompt_tokens,
            "first_token_id": request.output_token_ids[0],
            "block_size": self.block_sizes[0],
            "tp_size": 1,
            "lease_expires_at": self.wall_clock() + self.lease_seconds,
        }

    # --- every step ---------------------------------------------------------------
    def build_connector_meta(self, scheduler_output) -> NixlConnectorMetadata:
        meta, self._meta = self._meta, NixlConnectorMetadata()
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        pass


def remote_of(params: dict[str, Any]) -> RemotePrefill:
    lease = params.get("lease_expires_at")
    return RemotePrefill(str(params["remote_engine_id"]), str(params["remote_host"]),
                         int(params["remote_port"]), str(params["remote_request_id"]),
                         float(lease) if isinstance(lease, (int, float)) else None)


def remote_prefill_params(request: Request, num_groups: int, block_size: int) -> dict[str, Any]:
    """The request's kv_transfer_params, checked against what this server can load;
    raises KVTransferParamsError saying what does not fit."""
    params = request.kv_transfer_params or {}
    missing = [k for k in REQUIRED_D_PARAMS if k not in params]
    if missing:
        raise KVTransferParamsError(f"kv_transfer_params lacks {', '.join(missing)}")
    if params["num_prompt_tokens"] != request.num_prompt_tokens:
        raise KVTransferParamsError(f"the prefill covered {params['num_prompt_tokens']} prompt tokens, "
                                    f"this request has {request.num_prompt_tokens}")
    if params.get("block_size", block_size) != block_size:
        raise KVTransferParamsError(f"block size {params.get('block_size')} differs from ours ({block_size})")
    remote = params["remote_block_ids"]
    expected = cdiv(request.num_prompt_tokens, block_size)
    if (not isinstance(remote, list) or len(remote) != num_groups
            or any(not isinstance(ids, list) or len(ids) != expected
                   or not all(isinstance(b, int) and b >= 0 for b in ids) for ids in remote)):
        raise KVTransferParamsError(f"remote_block_ids must be {num_groups} lists of {expected} block ids")
    return params
