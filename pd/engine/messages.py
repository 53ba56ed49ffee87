"""What the server and the engine-core process say to each other over ZMQ.

Every message is a msgspec Struct encoded as msgpack; nothing received is unpickled.
Input (server -> core) is the tagged union `EngineInput`, output (core -> server) the
tagged union `EngineOutput`. The conversion helpers turn these into the engine's own
dataclasses and back; the `pd` modules that need torch are imported only inside them,
so the server side of the wire imports without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from connectors.params import RemoteDecodeParams, RemotePrefillParams, TransferParams
from pd.logprobs import Logprobs, PromptLogprobs
from pd.structured.grammar import Grammar

if TYPE_CHECKING:
    from pd.engine.core import EngineCore, EngineStats
    from pd.outputs import RequestOutput
    from pd.request import Request, SamplingParams


# ---- server -> core ---------------------------------------------------------------


# The SamplingParams fields an EngineRequest carries, by the same names.
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos",
                   "logit_bias", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                   "min_tokens", "logprobs", "prompt_logprobs", "n", "grammar")


class EngineRequest(msgspec.Struct, tag=True, kw_only=True):
    """A request to add: token ids and the fields of `SamplingParams`, unvalidated (the
    core validates them and answers a bad one with an error output). The PD parameters
    travel as `remote_decode` (P keeps the blocks for a decode server) or
    `remote_prefill` (D reads them from P), already typed (connectors/params.py)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logit_bias: list[tuple[int, float]] = []
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    grammar: Grammar | None = None
    remote_decode: bool = False
    remote_prefill: RemotePrefillParams | None = None
    cache_salt: str | None = None

    @classmethod
    def create(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               kv_transfer_params: TransferParams | None = None,
               cache_salt: str | None = None) -> EngineRequest:
        sampling = {name: getattr(params, name) for name in SAMPLING_FIELDS}
        sampling = {name: list(v) if isinstance(v, tuple) else v for name, v in sampling.items()}  # as declared
        return cls(request_id=request_id, prompt_token_ids=list(prompt_token_ids), **sampling,
                   remote_decode=isinstance(kv_transfer_params, RemoteDecodeParams),
                   remote_prefill=kv_transfer_params if isinstance(kv_transfer_params, RemotePrefillParams) else None,
                   cache_salt=cache_salt)

    @property
    def kv_transfer_params(self) -> TransferParams | None:
        if self.remote_prefill is not None:
            return self.remote_prefill
        return RemoteDecodeParams(True) if self.remote_decode else None

    def sampling_params(self) -> SamplingParams:
        """The validated params; ValueError if a field is out of range."""
        from pd.request import SamplingParams

        return SamplingParams(**{name: getattr(self, name) for name in SAMPLING_FIELDS})  # it makes lists tuples

    def to_request(self) -> Request:
        """The engine's Request; ValueError for bad params or an empty prompt."""
        from pd.request import Request

        return Request(self.request_id, list(self.prompt_token_ids), self.sampling_params(),
                       kv_transfer_params=self.kv_transfer_params, cache_salt=self.cache_salt)


class ReleaseKV(msgspec.Struct, tag=True):
    """Free now the blocks a prefill server keeps for these finished requests (their
    decode server failed or refused them); ids not held are ignored."""

    request_ids: list[str]


class AbortRequests(msgspec.Struct, tag=True):
    """Finish these requests as aborted; unknown (or already finished) ids are ignored."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True):
    """Stop the loop, shut the core down and exit 0."""


EngineInput = EngineRequest | AbortRequests | ReleaseKV | Shutdown


# ---- core -> server ---------------------------------------------------------------


class EngineInfo(msgspec.Struct, kw_only=True):
    """What the server needs to know about the engine it talks to. `group_names[i]`
    and `block_sizes[i]` describe KV cache group i; `engine_id` is the one its
    connector hands out in kv_transfer_params."""

    engine_id: str
    kv_connector: str  # "none": this engine takes no part in PD
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    group_names: list[str]
    num_blocks: int
    block_sizes: list[int]
    architectures: list[str]
    stats: EngineStatsMsg  # at start-up: what /metrics shows before the first step
    kv_events: dict[str, str] | None = None  # {"publisher": tcp://..., "replay": tcp://...} when published

    @classmethod
    def from_core(cls, core: EngineCore) -> EngineInfo:
        from pd.engine.core import group_names

        kv = core.kv_cache_config
        return cls(engine_id=core.engine_id, kv_connector=core.config.kv_connector, max_model_len=core.max_model_len,
                   vocab_size=core.model_config.vocab_size,
                   eos_token_ids=sorted(core.model_config.eos_token_ids),
                   group_names=group_names(kv), num_blocks=kv.num_blocks,
                   block_sizes=kv.block_sizes,
                   architectures=core.model_config.architectures, kv_events=core.kv_events_endpoints,
                   stats=EngineStatsMsg.from_stats(core.stats()))


class RequestOutputMsg(msgspec.Struct, kw_only=True):
    """`RequestOutput` on the wire. `error` alone (no `finish_reason`): the core refused
    the request, which never ran and is already forgotten. `error` with finish_reason
    "error": the request was admitted and then failed. `error_code` says why (see
    `pd.outputs.ErrorCode`)."""

    request_id: str
    new_token_ids: list[int] = []
    finish_reason: str | None = None
    kv_transfer_params: RemotePrefillParams | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    error_code: str | None = None
    index: int = 0
    logprobs: Logprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def finished(self) -> bool:
        """The last output this request will get."""
        return self.finish_reason is not None or self.error is not None

    @classmethod
    def from_output(cls, output: RequestOutput) -> RequestOutputMsg:
        return cls(request_id=output.request_id, new_token_ids=list(output.new_token_ids),
                   finish_reason=output.finish_reason, kv_transfer_params=output.kv_transfer_params,
                   num_cached_tokens=output.num_cached_tokens, error=output.error,
                   error_code=output.error_code, index=output.index, logprobs=output.logprobs,
                   prompt_logprobs=output.prompt_logprobs)

    @property
    def is_refusal(self) -> bool:
        return self.error is not None and self.finish_reason is None

    @classmethod
    def refused(cls, request_id: str, error: str, code: str) -> RequestOutputMsg:
        return cls(request_id=request_id, error=error, error_code=code)

    def to_output(self) -> RequestOutput:
        """The engine's RequestOutput (a refusal has no counterpart there)."""
        from pd.outputs import RequestOutput

        return RequestOutput(self.request_id, list(self.new_token_ids), self.finish_reason,
                             self.kv_transfer_params, self.num_cached_tokens, self.error, self.error_code,
                             self.prompt_logprobs, self.index, self.logprobs)


class EngineStatsMsg(msgspec.Struct, kw_only=True):
    """`EngineStats` on the wire (see pd/engine/core.py)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    group_names: list[str] = []
    group_queries: list[int] = []
    group_hits: list[int] = []
    kv_transfer: dict[str, float] = {}
    kv_transfer_histograms: dict[str, HistogramMsg] = {}
    kv_load_failures: dict[str, int] = {}
    prompt_tokens_by_source: dict[str, int] = {}
    num_steps: int = 0
    step_seconds: dict[str, float] = {}  # the core's STEP_PARTS, and "ipc": the loop's messaging

    @classmethod
    def from_stats(cls, stats: EngineStats, ipc_seconds: float = 0.0) -> EngineStatsMsg:
        return cls(num_running=stats.num_running, num_waiting=stats.num_waiting,
                   kv_usage=stats.kv_usage, num_preemptions=stats.num_preemptions,
                   prefix_cache_queries=stats.prefix_cache_queries,
                   prefix_cache_hits=stats.prefix_cache_hits, group_names=list(stats.group_names),
                   group_queries=list(stats.group_queries), group_hits=list(stats.group_hits),
                   kv_transfer=dict(stats.kv_transfer),
                   kv_transfer_histograms={name: HistogramMsg(list(buckets), list(counts), total)
                                           for name, (buckets, counts, total) in stats.kv_transfer_histograms.items()},
                   kv_load_failures=dict(stats.kv_load_failures),
                   prompt_tokens_by_source=dict(stats.prompt_tokens_by_source),
                   num_steps=stats.num_steps, step_seconds={**stats.step_seconds, "ipc": ipc_seconds})

    def without_timing(self) -> EngineStatsMsg:
        """The same stats but the step counters, which move on every step."""
        return msgspec.structs.replace(self, num_steps=0, step_seconds={})


class HistogramMsg(msgspec.Struct):
    """A histogram: `counts[i]` observations <= `buckets[i]` (not cumulative), the last
    count above every bucket, and the sum of all observations."""

    buckets: list[float]
    counts: list[int]
    total: float


class Ready(msgspec.Struct, tag=True):
    """The core is built and reading its input."""

    info: EngineInfo


class StartupFailed(msgspec.Struct, tag=True):
    """Building the core raised; the process exits non-zero after sending this."""

    error: str


class StepOutputs(msgspec.Struct, tag=True):
    """One step's outputs (with those of the aborts and refusals applied before it) and
    the stats after it."""

    outputs: list[RequestOutputMsg]
    stats: EngineStatsMsg


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
