"""What the server and the engine-core process say to each other over ZMQ.

Every message is a msgspec Struct encoded as msgpack; nothing received is unpickled.
Input (server -> core) is the tagged union `EngineInput`, output (core -> server) the
tagged union `EngineOutput`. `EngineRequest` becomes the engine's `Request` (the `pd`
modules that need torch are imported only inside its helpers, so the server side of the
wire imports without torch); outputs (`pd.contracts.request.RequestOutput`) and `EngineStats` are
the engine's own Structs, sent as they are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from pd.contracts.request import RequestOutput
from pd.contracts.sampling_params import SamplingParams
from pd.kv_transfer.params import RemotePrefillParams, TransferParams

if TYPE_CHECKING:
    from pd.contracts.request import Request


# ---- server -> core ---------------------------------------------------------------


class EngineRequest(msgspec.Struct, tag=True, kw_only=True):
    """A request to add: its token ids, its `SamplingParams` (checked again as the
    engine process decodes them: a bad set is answered with an error output) and its
    PD parameters, already typed (pd/kv_transfer/params.py).

    `resumed`: a stream taken up from another server, per sequence the tokens it
    generated there (None: it had ended there, and is not run). Each sequence left to run
    is a request of its own from the start (sequence j as an n > 1 request forks it: its
    own seed), its tokens computed with the prompt and counted as its output (max_tokens,
    penalties, its grammar, a seed's draws). `resumed_kv`: per sequence, where the KV of
    its prompt and its tokens but the last is kept for it to read (a draining server
    handed it on), or None: it is computed here."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    kv_transfer_params: TransferParams | None = None
    cache_salt: str | None = None
    resumed: list[list[int] | None] = []
    resumed_kv: list[TransferParams | None] = []

    @classmethod
    def create(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               kv_transfer_params: TransferParams | None = None, cache_salt: str | None = None,
               resumed: list[list[int] | None] | None = None,
               resumed_kv: list[TransferParams | None] | None = None) -> EngineRequest:
        return cls(request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling_params=params,
                   kv_transfer_params=kv_transfer_params, cache_salt=cache_salt, resumed=list(resumed or []),
                   resumed_kv=list(resumed_kv or []))

    @property
    def sequences(self) -> list[int]:
        """The indices of the sequences the engine runs for it."""
        if not self.resumed:
            return list(range(self.sampling_params.n))
        return [j for j, tokens in enumerate(self.resumed) if tokens is not None]

    def to_requests(self) -> list[Request]:
        """The engine's Requests: the request, or each resumed sequence left to run;
        ValueError for an empty prompt, or a resume that does not fit its `n`."""
        from pd.contracts.request import Request, sequence_id

        if not self.resumed:
            return [Request(self.request_id, list(self.prompt_token_ids), self.sampling_params,
                            kv_transfer_params=self.kv_transfer_params, cache_salt=self.cache_salt)]
        params = self.sampling_params
        kv = self.resumed_kv or [None] * len(self.resumed)
        if len(self.resumed) != params.n or len(kv) != params.n or self.kv_transfer_params is not None:
            raise ValueError(f"a resumed request has one entry per sequence ({params.n}) and no kv_transfer_params")
        if any(k is not None and (t is None or not t or not isinstance(k, RemotePrefillParams))
               for t, k in zip(self.resumed, kv)):
            raise ValueError("resumed KV is read only by a sequence that goes on with tokens")
        return [Request(sequence_id(self.request_id, j), list(self.prompt_token_ids), params.for_sequence(j),
                        kv_transfer_params=kv[j], cache_salt=self.cache_salt, output_token_ids=list(tokens),
                        index=j, parent_id=self.request_id if j else None)
                for j, tokens in enumerate(self.resumed) if tokens is not None]


def refused_request_id(frame: bytes) -> str | None:
    """The id of an `EngineRequest` frame that did not decode (its sampling parameters
    out of range, say), so that it can be answered with an error output instead of
    leaving its caller waiting; None when the frame names none."""
    try:
        fields = msgspec.msgpack.decode(frame)
    except Exception:  # not msgpack at all
        return None
    if isinstance(fields, dict) and fields.get("type") == "EngineRequest":
        request_id = fields.get("request_id")
        return request_id if isinstance(request_id, str) and request_id else None
    return None


class ReleaseKV(msgspec.Struct, tag=True):
    """Free now the blocks a prefill server keeps for these finished requests (their
    decode server failed or refused them); ids not held are ignored."""

    request_ids: list[str]


class AbortRequests(msgspec.Struct, tag=True):
    """Finish these requests as aborted; unknown (or already finished) ids are ignored."""

    request_ids: list[str]


class MigrateRequests(msgspec.Struct, tag=True):
    """Hand these requests on to another server with their KV (a draining server's
    streams): each sequence finishes as migrated at a step boundary, its blocks kept for
    the reader its output's kv_transfer_params name. Unknown ids are ignored."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True):
    """Stop the loop, shut the core down and exit 0."""


EngineInput = EngineRequest | AbortRequests | ReleaseKV | MigrateRequests | Shutdown


# ---- core -> server ---------------------------------------------------------------


class EngineInfo(msgspec.Struct, kw_only=True):
    """What the server needs to know about the engine it talks to. `group_names[i]`
    and `block_sizes[i]` describe KV cache group i; `engine_id` is the one its
    connector hands out in kv_transfer_params."""

    engine_id: str
    kv_connector: str  # "null": this engine takes no part in PD
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    group_names: list[str]
    num_blocks: int
    block_sizes: list[int]
    architectures: list[str]
    stats: EngineStats  # at start-up: what /metrics shows before the first step
    kv_events: dict[str, str] | None = None  # {"publisher": tcp://..., "replay": tcp://...} when published
    compat_hash: str = ""  # equal on engines whose KV blocks mean the same (pd/kv_transfer/compat.py)
    kv_offload: list[str] = []  # the offload tiers, a line each for the server's start-up output


class HistogramSnapshot(msgspec.Struct):
    """A histogram: `counts[i]` observations <= `buckets[i]` (not cumulative), the last
    count above every bucket, and the sum of all observations."""

    buckets: list[float]
    counts: list[int]
    total: float


class EngineStats(msgspec.Struct, kw_only=True):
    """A snapshot for metrics, made by the core (`EngineCore.stats`) and sent as it is:
    queue sizes, KV usage and prefix-cache counters (tokens), overall and per KV cache
    group (`group_names[i]` names group i)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    group_names: list[str] = []
    group_queries: list[int] = []
    group_hits: list[int] = []
    kv_transfer: dict[str, float] = {}  # the connector's counters, if any
    kv_transfer_histograms: dict[str, HistogramSnapshot] = {}  # the connector's histograms
    kv_transfer_by_rank: dict[str, dict[int, int]] = {}  # figure -> tensor-parallel rank -> value
    kv_transfer_path: str = ""  # what KV read crosses (connectors/nixl/ucx.py `path`)
    kv_cache_bytes: list[int] = []  # KV cache memory of each tensor-parallel rank
    kv_load_failures: dict[str, int] = {}  # by policy action: recompute / fail
    kv_prefix_reads_skipped: int = 0  # P: exported prefixes it held already (nothing read)
    prompt_tokens_by_source: dict[str, int] = {}  # computed / local_cache / remote / disk
    kv_offload: dict[str, dict[str, float]] = {}  # per offload tier (pd/kv_offload): its counters and gauges
    kv_offload_load_seconds: dict[str, HistogramSnapshot] = {}  # per offload tier: how long its loads took
    malformed_messages: dict[str, int] = {}  # dropped as malformed, by listener (pd.server.metrics.LISTENERS)
    kv_events_replies_dropped: int = 0  # replay replies to clients that did not read them
    num_steps: int = 0
    step_seconds: dict[str, float] = {}  # the core's STEP_PARTS -> seconds since start; "ipc": the loop's messaging

    def without_timing(self) -> EngineStats:
        """The same stats but the step counters, which move on every step."""
        return msgspec.structs.replace(self, num_steps=0, step_seconds={})


class Ready(msgspec.Struct, tag=True):
    """The core is built and reading its input."""

    info: EngineInfo


class StartupFailed(msgspec.Struct, tag=True):
    """Building the core raised; the process exits non-zero after sending this."""

    error: str


class StepOutputs(msgspec.Struct, tag=True):
    """One step's outputs (with those of the aborts and refusals applied before it) and
    the stats after it."""

    outputs: list[RequestOutput]
    stats: EngineStats


class EngineFailed(msgspec.Struct, tag=True):
    """The core hit an error it cannot pin on one request and stops; the process exits
    non-zero after sending this."""

    error: str


EngineOutput = Ready | StartupFailed | StepOutputs | EngineFailed


# ---- codecs -----------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()


def encode(message: Any) -> bytes:
    return _encoder.encode(message)


def input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineInput)


def output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineOutput)
