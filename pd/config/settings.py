"""The groups of an engine's settings, each frozen and checked once in `__post_init__`:
model, cache, scheduler, parallel, offload and telemetry (the transfer group is the KV
transfer room's own: pd/kv_transfer/connector_config.py). A setting is declared once,
with its default; its flat name (the `pd serve` flag's, and `pd.LLM`'s keyword) is the
field's own unless its metadata says another (`flat`). What needs files, devices or the
environment is left as asked (`auto`, None) for `EngineConfig.resolve`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pd.models.model_config import AUTO_DTYPE, SUPPORTED_DTYPES

KV_LAYOUTS = ("canonical", "per-layer")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
QUANTIZATIONS = ("auto", "none", "int8", "gguf")  # int8: pd.models.quantized; gguf: pd.models.gguf_linear
LOGPROBS_MODES = ("processed", "raw")  # pd/logprobs.py
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": "float8_e4m3fn", "int8": "int8"}  # --kv-cache-dtype -> KV dtype name
STEP_LIMITS = ("auto", "off")  # --max-step-ms besides a number (pd/scheduling/step_budget.py)
AS_ASKED = "as asked"  # how a setting that `resolve` did not have to choose was chosen


def _one_of(name: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def _positive(name: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


def _port(name: str, value: int) -> None:
    if not 0 <= value <= 65535:
        raise ValueError(f"{name} must be a TCP port (1-65535, or 0: any free one), got {value}")


@dataclass(frozen=True)
class ModelSettings:
    """The checkpoint and how it is computed. `dtype` and `quantization` "auto", resolved
    with the reason (`*_reason`); `device` None: CUDA when present, else the CPU."""

    path: Path = field(metadata={"flat": "model"})
    dtype: str = AUTO_DTYPE  # auto: the checkpoint's own (see resolve_dtype)
    quantization: str = "auto"  # auto: resolve_quantization; int8, gguf: see QUANTIZATIONS
    logprobs_mode: str = "processed"  # sampled tokens' logprobs: after bias and penalties, or raw
    device: str | None = None
    max_model_len: int | None = None  # None: the model's own limit
    seed: int = 0
    dtype_reason: str = field(default=AS_ASKED, compare=False, metadata={"resolved": True})
    quantization_reason: str = field(default=AS_ASKED, compare=False, metadata={"resolved": True})

    def __post_init__(self) -> None:
        if not isinstance(self.path, Path):
            raise TypeError(f"the model's path must be a Path, got {type(self.path).__name__}")
        _one_of("dtype", self.dtype, (AUTO_DTYPE, *SUPPORTED_DTYPES))
        _one_of("quantization", self.quantization, QUANTIZATIONS)
        _one_of("logprobs_mode", self.logprobs_mode, LOGPROBS_MODES)
        _positive("max_model_len", self.max_model_len)

    @property
    def torch_device(self) -> str:
        if self.device is not None:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class CacheSettings:
    """The KV cache: block size, its dtype, its size per rank ("auto": sized to the
    machine, pd/kv_cache/sizing.py), prefix caching and the layout of its memory."""

    block_size: int = 16
    dtype: str = field(default="auto", metadata={"flat": "kv_cache_dtype"})  # KV_CACHE_DTYPES
    memory: int | str = field(default="auto", metadata={"flat": "kv_cache_memory"})  # bytes per rank, or auto
    max_tokens: int | None = field(default=None, metadata={"flat": "kv_cache_max_tokens"})  # auto sets it
    enable_prefix_caching: bool = True
    layout: str = field(default="canonical", metadata={"flat": "kv_layout"})
    hybrid: bool = field(default=True, metadata={"flat": "hybrid_kv_cache"})  # one group per attention type
    memory_reason: str = field(default=AS_ASKED, compare=False, metadata={"resolved": True})

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _one_of("kv_cache_dtype", self.dtype, tuple(KV_CACHE_DTYPES))
        _one_of("kv_layout", self.layout, KV_LAYOUTS)
        if self.memory != "auto" and (not isinstance(self.memory, int) or isinstance(self.memory, bool)):
            raise ValueError(f"kv_cache_memory must be a number of bytes or auto, got {self.memory!r}")
        if self.memory != "auto":
            _positive("kv_cache_memory", self.memory)
        _positive("kv_cache_max_tokens", self.max_tokens)

    @property
    def attention_kv_dtype(self) -> str | None:
        """The attention KV dtype name where --kv-cache-dtype sets one (None: the model's)."""
        return KV_CACHE_DTYPES[self.dtype]


@dataclass(frozen=True)
class SchedulerSettings:
    """The batch's bounds, admission, and what the scheduler does with remote KV."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_step_ms: float | str = "auto"  # a step's time with a prefill chunk beside decodes: ms, auto or off
    reserve_growth_tokens: int = 128  # admit only while this many more tokens of every request fit
    kv_load_failure_policy: str = "recompute"  # D: a request whose remote KV fails to load
    kv_max_held_fraction: float = 0.5  # P: share of blocks kept for unread requests before refusing more
    skip_partial_groups_on_remote_prefill: bool = True  # D: see --no-skip-partial-groups-on-remote-prefill

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_step_ms not in STEP_LIMITS:
            if not isinstance(self.max_step_ms, int | float) or isinstance(self.max_step_ms, bool):
                raise ValueError(f"max_step_ms must be a number of milliseconds, auto or off, got {self.max_step_ms!r}")
            _positive("max_step_ms", self.max_step_ms)
        if self.reserve_growth_tokens < 0:
            raise ValueError(f"reserve_growth_tokens must not be negative, got {self.reserve_growth_tokens}")
        _one_of("kv_load_failure_policy", self.kv_load_failure_policy, KV_LOAD_FAILURE_POLICIES)
        if not 0.0 < self.kv_max_held_fraction <= 1.0:
            raise ValueError(f"kv_max_held_fraction must be in (0, 1], got {self.kv_max_held_fraction}")


@dataclass(frozen=True)
class ParallelSettings:
    """Tensor parallelism (ranks, one process each: pd/worker/tp_ranks.py) and CPU threads."""

    size: int = field(default=1, metadata={"flat": "tensor_parallel_size"})
    timeout: float = field(default=60.0, metadata={"flat": "tp_timeout"})  # a collective's wait before the engine stops
    local_ranks: int | None = field(default=None, metadata={"flat": "tp_local_ranks"})  # None: all on this node
    host: str = field(default="127.0.0.1", metadata={"flat": "tp_host"})  # where ranks of other nodes join
    port: int = field(default=0, metadata={"flat": "tp_port"})  # the join listener's (not 0 with remote ranks)
    num_threads: int | None = None  # torch intra-op threads; None: torch's default (all cores)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.size}")
        _positive("tp_timeout", self.timeout)
        _positive("num_threads", self.num_threads)
        if not 1 <= self.ranks_here <= self.size:
            raise ValueError(f"tp_local_ranks must be in 1..tensor_parallel_size ({self.size}), got {self.local_ranks}")
        if self.ranks_here < self.size and not 0 < self.port < 65536:
            raise ValueError("ranks on other nodes join at --tp-host:--tp-port: give a port (they must know it), "
                             f"got {self.port}")

    @property
    def ranks_here(self) -> int:
        """Ranks on the engine's own node, rank 0 included: 0..ranks_here-1; the others
        join from other nodes (`pd tp-rank`)."""
        return self.size if self.local_ranks is None else self.local_ranks


@dataclass(frozen=True)
class OffloadSettings:
    """The KV offload tiers (pd/kv_offload); None: that tier is not configured."""

    host_bytes: int | None = field(default=None, metadata={"flat": "kv_offload_host_bytes"})
    disk_path: Path | None = field(default=None, metadata={"flat": "kv_offload_disk_path"})
    disk_bytes: int | None = field(default=None, metadata={"flat": "kv_offload_disk_bytes"})  # None: sized there

    def __post_init__(self) -> None:
        if self.disk_path is None and self.disk_bytes is not None:
            raise ValueError("kv_offload_disk_bytes sizes the disk tier: give kv_offload_disk_path too")
        if self.disk_path is not None and not isinstance(self.disk_path, Path):
            raise TypeError(f"kv_offload_disk_path must be a Path, got {type(self.disk_path).__name__}")
        _positive("kv_offload_host_bytes", self.host_bytes)
        _positive("kv_offload_disk_bytes", self.disk_bytes)

    @property
    def any(self) -> bool:
        return self.host_bytes is not None or self.disk_path is not None


@dataclass(frozen=True)
class TelemetrySettings:
    """The KV events this engine publishes for a KV-aware router (kv_events/); None: off."""

    events_port: int | None = field(default=None, metadata={"flat": "kv_events_port"})  # 0: any free port
    replay_port_asked: int | None = field(default=None, metadata={"flat": "kv_events_replay_port"})
    events_host: str = field(default="127.0.0.1", metadata={"flat": "kv_events_host"})

    def __post_init__(self) -> None:
        if self.events_port is None:
            return
        _port("kv_events_port", self.events_port)
        _port("kv_events_replay_port", self.replay_port)
        if self.events_port and self.events_port == self.replay_port:
            raise ValueError("kv_events_port and kv_events_replay_port must differ")

    @property
    def replay_port(self) -> int:
        """The replay socket's port: as asked, else the events port + 1 (0 with port 0: any)."""
        if self.replay_port_asked is not None:
            return self.replay_port_asked
        return self.events_port + 1 if self.events_port else 0
