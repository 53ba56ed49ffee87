"""A request as the engine sees it: token ids, progress and status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import msgspec

from kv_events.hashing import BlockHash, extend_block_hashes
from pd.contracts.sampling_params import SamplingParams
from pd.kv_transfer.params import RemoteDecodeParams, RemotePrefillParams, TransferParams
from pd.logprobs import Logprobs, PromptLogprobs
from wire.codes import MIGRATED


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    WAITING_FOR_GRAMMAR = enum.auto()  # its grammar compiles (pd/structured)
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # failed in the engine (its remote KV could not be loaded)
    FINISHED_MIGRATED = enum.auto()  # paused here and handed on with its KV (a draining server's streams)


class RequestTimes(msgspec.Struct):
    """When a request's life in the engine passed each point, wall-clock seconds
    (`time.time()`, comparable across the processes of a host): arrived at the engine,
    first scheduled, parked for remote KV (`kv_tokens` to read) and when it landed (with
    the bytes and transfer descriptors the read moved, where the connector says, or why
    it failed), its first token, finished. None: it never passed that point. A finishing
    output carries them (the server's trace makes spans of them)."""

    arrival: float
    scheduled: float | None = None
    kv_wait: float | None = None
    kv_landed: float | None = None
    kv_tokens: int = 0
    kv_bytes: int | None = None
    kv_descriptors: int | None = None
    kv_error: str | None = None  # why the KV it waited for could not be loaded (it was computed, or it failed)
    first_token: float | None = None
    finished: float | None = None


@dataclass(eq=False)
class Request:
    """One request. `num_computed_tokens` counts tokens whose KV is in the cache.

    `kv_transfer_params` are its typed PD parameters (pd/kv_transfer/params.py), if any. On
    D they are dropped once the remote KV has landed: from then on the request is a
    local one (a preemption recomputes it here and never reads P again). On P a prefix
    read from a decode server is dropped from them likewise (`remote_kv_landed`).
    `cache_salt` keeps this request's prefix-cache entries apart from other salts.

    A request asking for n > 1 sequences forks at its first token: it stays sequence 0,
    and sequence j is a request of its own (`sequence_id(request_id, j)`, `parent_id` the
    request's id, `index` j). Outputs name the client's request, `output_id`, and the index.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    kv_transfer_params: TransferParams | None = None
    cache_salt: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    kv_load_error: str | None = None  # why its remote KV could not be loaded, if it could not
    prompt_logprobs: PromptLogprobs | None = None  # scored so far, if asked for
    output_logprobs: Logprobs | None = None  # of each output token, if asked for
    parent_id: str | None = None  # the request it forked from (sequence `index` of it)
    index: int = 0
    fork_token_ids: list[int] = field(default_factory=list)  # first tokens of sequences 1.. when it forked
    fork_logprobs: Logprobs | None = None  # and their logprobs, if asked for
    writes_prefix_cache: bool = True  # False: its blocks hold KV not verified as its prompt's (unsigned remote KV)
    kv_loaded_from: str | None = None  # where KV it waited for came from: "remote" (a server), or a tier ("disk")
    last_step: int = -1  # the scheduler's last step that computed it (-1: none yet)
    prompt_sources: dict[str, int] = field(default_factory=dict)  # where its prompt's KV came from (PromptSources)
    prefill_sources: dict[str, int] | None = None  # D: where the prefill server's came from, once its KV landed
    times: RequestTimes = field(default_factory=lambda: RequestTimes(time.time()))
    _block_hashes: dict[int, list[BlockHash]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r} has an empty prompt")
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = PromptLogprobs(start=1)
        if self.sampling_params.logprobs is not None and self.output_logprobs is None:
            self.output_logprobs = Logprobs()

    @property
    def first_token_ids(self) -> list[int]:
        """The first token of each of its sequences (it and those it forked)."""
        return self.output_token_ids[:1] + self.fork_token_ids

    @property
    def first_logprobs(self) -> Logprobs | None:
        """Their logprobs, if asked for."""
        if self.output_logprobs is None:
            return None
        rows = self.output_logprobs.rows(0, 1)
        if self.fork_logprobs is not None:
            rows.append(self.fork_logprobs)
        return rows

    @property
    def client_sources(self) -> dict[str, int]:
        """Where the prompt's KV came from as the client counts it, for the whole
        deployment: what the prefill server said when this server read its KV (P computed
        those tokens for this request: they were not a cache's), else this server's own
        `prompt_sources`."""
        return self.prefill_sources or self.prompt_sources

    @property
    def output_id(self) -> str:
        """The id its outputs carry: the client's request (the parent's, for a fork)."""
        return self.parent_id or self.request_id

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens whose KV is not computed yet: 1 for a decoding sequence."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def do_remote_prefill(self) -> bool:
        """True on D for a request whose prompt KV comes from a remote prefill and has
        neither landed nor failed to (either makes it an ordinary request computed here)."""
        return isinstance(self.kv_transfer_params, RemotePrefillParams) and self.kv_load_error is None

    @property
    def remote_prefill(self) -> RemotePrefillParams | None:
        params = self.kv_transfer_params
        return params if isinstance(params, RemotePrefillParams) else None

    @property
    def do_remote_decode(self) -> bool:
        """True on P for a request whose blocks are kept for a decode server."""
        return isinstance(self.kv_transfer_params, RemoteDecodeParams)

    @property
    def reads_prefix(self) -> bool:
        """True on P for a request that reads a prefix's KV from a decode server (or tried
        to: a failed read is computed here, whatever the load failure policy)."""
        params = self.kv_transfer_params
        return isinstance(params, RemoteDecodeParams) and params.prefix is not None

    @property
    def kv_source(self) -> RemotePrefillParams | None:
        """Where the KV this request loads before it computes is, while it is to be loaded:
        on D, P's parameters for the whole prompt; on P, a decode server's for a prefix."""
        if self.kv_load_error is not None:
            return None
        params = self.kv_transfer_params
        return params.prefix if isinstance(params, RemoteDecodeParams) else params

    def remote_kv_landed(self) -> None:
        """Its remote KV is in its blocks: on D a local request from now on (what P said of
        where its prompt came from kept: `prefill_sources`); on P one that keeps its blocks
        for a decode server and reads nothing more."""
        params = self.kv_transfer_params
        if isinstance(params, RemotePrefillParams) and params.prompt_sources is not None:
            self.prefill_sources = params.prompt_sources.counts()
        self.kv_transfer_params = RemoteDecodeParams(do_remote_decode=True) \
            if isinstance(params, RemoteDecodeParams) else None

    def append_output_token_ids(self, *token_ids: int) -> None:
        if not self.output_token_ids and token_ids:
            self.times.first_token = time.time()
        self.output_token_ids.extend(token_ids)

    def fork(self, index: int, token_id: int, logprobs: Logprobs | None) -> Request:
        """Its sequence `index` (a request of its own, with the first token `token_id`)."""
        child = Request(sequence_id(self.request_id, index), self.prompt_token_ids,
                        self.sampling_params.for_sequence(index), cache_salt=self.cache_salt,
                        num_cached_tokens=self.num_cached_tokens, parent_id=self.request_id, index=index,
                        prompt_sources=dict(self.prompt_sources), prefill_sources=self.prefill_sources,
                        writes_prefix_cache=self.writes_prefix_cache)
        child.append_output_token_ids(token_id)
        child.add_output_logprobs(logprobs)
        return child

    def add_output_logprobs(self, rows: Logprobs | None) -> None:
        """Keep the logprobs of output tokens just appended (rows for a request that did
        not ask for them are dropped)."""
        if rows is not None and self.output_logprobs is not None:
            self.output_logprobs.append(rows)

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        if self.prompt_logprobs is None:
            raise ValueError(f"request {self.request_id!r} did not ask for prompt logprobs")
        self.prompt_logprobs.extend(chunk)

    @property
    def reads_prefix_cache(self) -> bool:
        """False for a request that scores its prompt: every prompt token is computed."""
        return self.sampling_params.prompt_logprobs is None

    def block_hashes(self, block_size: int) -> list[BlockHash]:
        """Hashes of this request's full blocks of `block_size` tokens, brought up to
        date incrementally (only blocks completed since the last call are hashed)."""
        hashes = self._block_hashes.setdefault(block_size, [])
        if len(hashes) < self.num_tokens // block_size:
            salt = self.cache_salt.encode() if self.cache_salt else b""
            extend_block_hashes(hashes, self.all_token_ids, block_size, salt)
        return hashes


def cached_tokens(sources: dict[str, int]) -> int:
    """Prompt tokens whose KV was not computed for the request: found in a prefix cache,
    loaded from an offload tier or read from another server's cache."""
    return sum(tokens for source, tokens in sources.items() if source != "computed")


def sequence_id(request_id: str, index: int) -> str:
    """The engine's id of sequence `index` of an n > 1 request (sequence 0 is the request)."""
    return request_id if index == 0 else f"{request_id}/{index}"


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_MIGRATED: MIGRATED,
}


class RequestOutput(msgspec.Struct):
    """What one step produced for one sequence of a request: new tokens, and how it ended
    if it did; the engine process sends it to the server as it is (pd/engine/ipc_messages.py).
    `request_id` is the client's request and `index` the sequence (0 unless it asked for
    n > 1). `finish_reason` is "stop", "length", "abort" or "error" (then `error` says
    why), or "migrated" (paused and handed on: `kv_transfer_params` name its KV, if the
    connector keeps it for a reader); `error` alone (no `finish_reason`): the engine refused the request, which never
    ran and is already forgotten. `kv_transfer_params` are the connector's parameters for
    the response (a prefill server's handle to its blocks); `error_code` is one of
    `pd.errors`' codes; `logprobs` score the new tokens, when asked for."""

    request_id: str
    new_token_ids: list[int] = []
    finish_reason: str | None = None
    kv_transfer_params: RemotePrefillParams | None = None
    prompt_sources: dict[str, int] = {}  # where the prompt's KV came from, for the client (Request.client_sources)
    error: str | None = None
    error_code: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # with the first token, when asked for
    index: int = 0
    logprobs: Logprobs | None = None
    times: RequestTimes | None = None  # on a finishing output

    @property
    def finished(self) -> bool:
        """The last output this request will get."""
        return self.finish_reason is not None or self.error is not None

    @property
    def is_refusal(self) -> bool:
        return self.error is not None and self.finish_reason is None

    @classmethod
    def refused(cls, request_id: str, error: str, code: str) -> RequestOutput:
        return cls(request_id, error=error, error_code=code)

    @classmethod
    def of(cls, request: Request, token_ids: list[int], status: RequestStatus | None = None,
           params: RemotePrefillParams | None = None, logprobs: Logprobs | None = None,
           prompt_logprobs: PromptLogprobs | None = None) -> RequestOutput:
        """The output of `request` (one sequence of the client's request) with these new
        tokens, finished if `status` is a finished one."""
        reason = FINISH_REASONS.get(status)
        if reason is not None:
            request.times.finished = time.time()
        return cls(request.output_id, token_ids, reason, params, request.client_sources,
                   prompt_logprobs=prompt_logprobs, index=request.index, logprobs=logprobs,
                   times=request.times if reason is not None else None)
