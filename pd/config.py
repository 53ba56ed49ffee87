"""EngineConfig: everything one engine is started with, and the CLI flags that fill it."""

from __future__ import annotations

import argparse
import ipaddress
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from pd.kv_transfer.connector_config import ConnectorConfig
from pd.kv_transfer.connectors import AUTO_CONNECTOR, KV_CONNECTORS, NULL_CONNECTOR
from pd.kv_transfer.signing import DEFAULT_ALLOWED_PEERS, SECRET_ENV, secret_from_env
from pd.models.model_config import AUTO_DTYPE, SUPPORTED_DTYPES, resolve_dtype, resolve_quantization

KV_LAYOUTS = ("canonical", "per-layer")
ROLES = ("both", "prefill", "decode")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
QUANTIZATIONS = ("auto", "none", "int8", "gguf")  # int8: pd.models.quantized; gguf: pd.models.gguf_linear
LOGPROBS_MODES = ("processed", "raw")  # pd/logprobs.py
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": "float8_e4m3fn", "int8": "int8"}  # --kv-cache-dtype -> KV dtype name
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # the server's --max-request-bytes


@dataclass(frozen=True)
class TierSettings:
    """The KV offload tiers an engine is started with (pd/kv_offload; None: that tier is
    not configured), and what the engine decides of them."""

    host_bytes: int | None = None
    disk_path: Path | None = None
    disk_bytes: int | None = None  # None: sized to the free space there
    compat_hash: str = ""
    engine_id: str = ""

    @property
    def any(self) -> bool:
        return self.host_bytes is not None or self.disk_path is not None


@dataclass(frozen=True)
class EngineConfig:
    """One engine's settings. `max_model_len=None` takes the model's own limit;
    `device=None` picks CUDA when present, else the CPU. `kv_connector` names an entry of
    pd/kv_transfer/connectors.py; "auto" takes "nixl" for the prefill and decode roles and "null"
    for `both`.

    The role sets defaults only: what a server does with a request is decided per
    request, by its `kv_transfer_params` (DESIGN.md, "PD protocol")."""

    model: Path
    dtype: str = AUTO_DTYPE  # resolved at construction: the checkpoint's own (see resolve_dtype)
    quantization: str = "auto"  # resolved at construction (resolve_quantization); int8, gguf: see QUANTIZATIONS
    logprobs_mode: str = "processed"  # sampled tokens' logprobs: after bias and penalties, or raw
    device: str | None = None
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # attention layers' KV: auto (the model's dtype), int8 or fp8_e4m3 (KV_CACHE_DTYPES)
    kv_cache_memory: int | str = "auto"  # bytes per rank; auto: resolved at construction (pd/kv_cache/sizing.py)
    kv_cache_max_tokens: int | None = None  # set by auto: the blocks a rank keeps at most (sizing.MAX_TOKENS)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    reserve_growth_tokens: int = 128  # see SchedulerConfig and --reserve-growth-tokens
    enable_prefix_caching: bool = True
    kv_layout: str = "canonical"
    hybrid_kv_cache: bool = True
    seed: int = 0
    role: str = "both"
    kv_connector: str = AUTO_CONNECTOR
    kv_host: str = "127.0.0.1"
    kv_side_channel_port: int = 0
    kv_lease_seconds: float = 60.0
    kv_read_timeout: float = 30.0  # D: a KV read still under way after this long fails (recompute / fail)
    kv_digest: bool = False  # digest the KV held for readers; a reader checks (pd/kv_transfer/digests.py)
    kv_ucx_transports: str = "auto"  # UCX_TLS for the NIXL agent; auto: shared memory + tcp on loopback
    skip_partial_groups_on_remote_prefill: bool = True  # D: see --no-skip-partial-groups-on-remote-prefill
    kv_load_failure_policy: str = "recompute"
    kv_max_held_fraction: float = 0.5  # P: share of blocks kept for unread requests before refusing more
    kv_transfer_secret: str | None = field(default=None, repr=False)  # signs / verifies kv_transfer_params; "": none
    allow_unsigned_kv_params: bool = False  # a NIXL server without a secret: refused unless this says so
    kv_allowed_peers: tuple[str, ...] = DEFAULT_ALLOWED_PEERS  # without a secret: the P hosts D trusts
    num_threads: int | None = None  # torch intra-op threads; None: torch's default (all cores)
    tensor_parallel_size: int = 1  # ranks the model is sharded over, one process each (pd/worker/tp_ranks.py)
    tp_timeout: float = 60.0  # seconds a collective waits for the other ranks before the engine stops
    tp_local_ranks: int | None = None  # ranks the engine starts on its node (rank 0 included); None: all
    tp_host: str = "127.0.0.1"  # with ranks on other nodes: where they join and reach the ranks' store
    tp_port: int = 0  # the join listener's port (needed, not 0, when ranks are on other nodes)
    kv_events_port: int | None = None  # publish KV events (kv_events/) on tcp://kv_events_host:port; None: off; 0: any
    kv_events_replay_port: int | None = None  # their replay socket; None: kv_events_port + 1 (0: any)
    kv_events_host: str = "127.0.0.1"
    kv_offload_host_bytes: int | None = None  # host memory for the host tier (pd/kv_offload); None: no such tier
    kv_offload_disk_path: Path | None = None  # a directory for the disk tier (pd/kv_offload); None: no such tier
    kv_offload_disk_bytes: int | None = None  # its size; None: a tenth of the free space there, at most 64 GiB
    dtype_reason: str = field(default="as asked", init=False, compare=False)  # how `dtype` was chosen
    quantization_reason: str = field(default="as asked", init=False, compare=False)  # how `quantization` was
    kv_cache_memory_reason: str = field(default="as asked", init=False, compare=False)  # how its size was

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", Path(self.model))
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.kv_connector == AUTO_CONNECTOR:
            object.__setattr__(self, "kv_connector", NULL_CONNECTOR if self.role == "both" else "nixl")
        if self.dtype not in (*SUPPORTED_DTYPES, AUTO_DTYPE):
            raise ValueError(f"dtype must be one of auto, {', '.join(SUPPORTED_DTYPES)}, got {self.dtype!r}")
        if self.dtype == AUTO_DTYPE:
            # the device (a torch import) is looked up only for a GGUF
            dtype, why = resolve_dtype(self.model, AUTO_DTYPE, lambda: self.torch_device)
            object.__setattr__(self, "dtype", dtype)
            object.__setattr__(self, "dtype_reason", why)
        self._check_quantization()
        self._resolve_kv_cache_memory()
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_connector must be one of {', '.join(KV_CONNECTORS.names())}, got {self.kv_connector!r}")
        self._check_kv_transfer()
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}")
        for name in ("block_size", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError(f"num_threads must be positive, got {self.num_threads}")
        self._check_tensor_parallel()
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        self._check_kv_events()
        self._check_offload()

    def _resolve_kv_cache_memory(self) -> None:
        if self.kv_cache_memory == "auto":
            from pd.kv_cache.sizing import MAX_TOKENS, auto_kv_cache_memory

            size, why = auto_kv_cache_memory(self.model, lambda: self.torch_device, self.tensor_parallel_size)
            object.__setattr__(self, "kv_cache_memory", size)
            object.__setattr__(self, "kv_cache_memory_reason", why)
            if self.kv_cache_max_tokens is None:
                object.__setattr__(self, "kv_cache_max_tokens", MAX_TOKENS)
        elif not isinstance(self.kv_cache_memory, int) or isinstance(self.kv_cache_memory, bool):
            raise ValueError(f"kv_cache_memory must be a number of bytes or auto, got {self.kv_cache_memory!r}")

    def _check_quantization(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization == "auto":
            quantization, why = resolve_quantization(self.model, self.dtype, lambda: self.torch_device,
                                                     self.tensor_parallel_size)
            object.__setattr__(self, "quantization", quantization)
            object.__setattr__(self, "quantization_reason", why)
        elif self.quantization == "gguf":
            from pd.models.gguf import is_gguf

            if not is_gguf(self.model):
                raise ValueError(f"quantization gguf computes from a .gguf file's blocks; {self.model} is not one")
            if self.tensor_parallel_size != 1:
                raise ValueError("quantization gguf serves one rank: use --tensor-parallel-size 1, or --quantization "
                                 "none or int8 with tensor parallelism")

    def _check_offload(self) -> None:
        if self.kv_offload_disk_path is None and self.kv_offload_disk_bytes is not None:
            raise ValueError("kv_offload_disk_bytes sizes the disk tier: give kv_offload_disk_path too")
        if self.kv_offload_disk_path is not None:
            object.__setattr__(self, "kv_offload_disk_path", Path(self.kv_offload_disk_path))
        for name in ("kv_offload_host_bytes", "kv_offload_disk_bytes"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_offload_host_bytes is None and self.kv_offload_disk_path is None:
            return
        if not self.enable_prefix_caching:
            raise ValueError("the KV offload tiers keep prefix-cache blocks: they need prefix caching on")
        if self.tensor_parallel_size > 1:
            raise ValueError("the KV offload tiers serve tensor-parallel size 1 for now (each rank would need its "
                             "own tiers and the loads joined across ranks)")

    def tier_settings(self, compat_hash: str, engine_id: str) -> TierSettings:
        """The offload tiers' settings (pd/kv_offload), with what the engine decides."""
        return TierSettings(self.kv_offload_host_bytes, self.kv_offload_disk_path, self.kv_offload_disk_bytes,
                            compat_hash, engine_id)

    def _check_kv_transfer(self) -> None:
        """The PD settings: leases, timeouts, transports, peers, the held share."""
        if self.kv_lease_seconds <= 0:
            raise ValueError(f"kv_lease_seconds must be positive, got {self.kv_lease_seconds}")
        if self.kv_read_timeout <= 0:
            raise ValueError(f"kv_read_timeout must be positive, got {self.kv_read_timeout}")
        if not self.kv_ucx_transports.strip() or any(c.isspace() for c in self.kv_ucx_transports):
            raise ValueError(f"kv_ucx_transports must be auto or a UCX_TLS list such as sm,self,tcp, "
                             f"got {self.kv_ucx_transports!r}")
        if not 0 <= self.kv_side_channel_port < 65536:
            raise ValueError(f"kv_side_channel_port must be a TCP port (0: any free one), got {self.kv_side_channel_port}")
        if self.role != "both" and self.kv_connector == NULL_CONNECTOR:
            raise ValueError(f"a {self.role} server moves KV to or from its peer: use --kv-connector nixl "
                             "(or --role both to serve alone)")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {', '.join(KV_LOAD_FAILURE_POLICIES)}, "
                             f"got {self.kv_load_failure_policy!r}")
        object.__setattr__(self, "kv_allowed_peers", tuple(self.kv_allowed_peers))
        if self.kv_transfer_secret is None:
            object.__setattr__(self, "kv_transfer_secret", secret_from_env())
        elif not self.kv_transfer_secret:  # "": none, whatever the environment says
            object.__setattr__(self, "kv_transfer_secret", None)
        if self.kv_connector != NULL_CONNECTOR and self.kv_transfer_secret is None and not self.allow_unsigned_kv_params:
            raise ValueError(f"a server with the {self.kv_connector} connector needs a transfer secret shared by the "
                             f"deployment ({SECRET_ENV}, or --kv-transfer-secret; the deploy scripts make one): without "
                             "it, any client that reaches a decode server can make it read any blocks of a prefill "
                             "server. --allow-unsigned-kv-params serves without one, trusting --kv-allowed-peers")
        for peer in self.kv_allowed_peers:
            try:
                ipaddress.ip_network(peer, strict=False)
            except ValueError:
                raise ValueError(f"kv_allowed_peers: {peer!r} is not an IP address or network") from None
        if not 0.0 < self.kv_max_held_fraction <= 1.0:
            raise ValueError(f"kv_max_held_fraction must be in (0, 1], got {self.kv_max_held_fraction}")

    def _check_tensor_parallel(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.tp_timeout <= 0:
            raise ValueError(f"tp_timeout must be positive, got {self.tp_timeout}")
        if not 1 <= self.local_ranks <= self.tensor_parallel_size:
            raise ValueError(f"tp_local_ranks must be in 1..tensor_parallel_size ({self.tensor_parallel_size}), "
                             f"got {self.tp_local_ranks}")
        if self.local_ranks < self.tensor_parallel_size and not 0 < self.tp_port < 65536:
            raise ValueError("ranks on other nodes join at --tp-host:--tp-port: give a port (they must know it), "
                             f"got {self.tp_port}")
        if self.local_ranks > 1 and self.torch_device.startswith("cuda"):
            self._check_cuda_devices()

    @property
    def local_ranks(self) -> int:
        """Ranks on the engine's own node, rank 0 included: 0..local_ranks-1; the others
        join from other nodes (`pd tp-rank`)."""
        return self.tensor_parallel_size if self.tp_local_ranks is None else self.tp_local_ranks

    def _check_cuda_devices(self) -> None:
        """A CUDA engine's ranks on its node take one device each, from its own on (NCCL
        refuses two ranks on one device)."""
        import torch

        first = int(self.torch_device.partition(":")[2] or 0)
        present = torch.cuda.device_count()
        if first + self.local_ranks > present:
            raise ValueError(f"{self.local_ranks} tensor-parallel ranks on {self.torch_device} need CUDA devices "
                             f"{first}..{first + self.local_ranks - 1}, one per rank; this machine has {present}")

    def _check_kv_events(self) -> None:
        if self.kv_events_port is None:
            return
        if self.kv_events_replay_port is None:
            object.__setattr__(self, "kv_events_replay_port", self.kv_events_port + 1 if self.kv_events_port else 0)
        for name in ("kv_events_port", "kv_events_replay_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be a TCP port (1-65535, or 0: any free one), got {getattr(self, name)}")
        if self.kv_events_port and self.kv_events_port == self.kv_events_replay_port:
            raise ValueError("kv_events_port and kv_events_replay_port must differ")

    def connector_config(self) -> ConnectorConfig:
        """What the KV connector is configured with (it sees nothing else of this)."""
        return ConnectorConfig(self.kv_host, self.kv_side_channel_port, self.kv_lease_seconds, self.kv_read_timeout,
                               self.kv_ucx_transports, self.kv_transfer_secret, self.kv_digest)

    def scheduler_config(self, max_model_len: int, eos_token_ids: frozenset[int],
                         mamba_block_size: int | None) -> SchedulerConfig:
        """What the scheduler takes of this config, with what the model decides."""
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, max_model_len, eos_token_ids,
                               mamba_block_size=mamba_block_size, kv_load_failure_policy=self.kv_load_failure_policy,
                               kv_max_held_fraction=self.kv_max_held_fraction,
                               skip_partial_groups_on_remote_prefill=self.skip_partial_groups_on_remote_prefill,
                               reserve_growth_tokens=self.reserve_growth_tokens)

    @property
    def attention_kv_dtype(self) -> str | None:
        """The attention KV dtype name where --kv-cache-dtype sets one (None: the model's)."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype]

    @property
    def torch_device(self) -> str:
        if self.device is not None:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineConfig":
        """The config from parsed flags (those `add_engine_flags` defines)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names and v is not None})


# What a flag defaults to is the field's default: one place for both.
ENGINE_DEFAULTS = {f.name: f.default for f in fields(EngineConfig) if f.init and f.default is not MISSING}


def _kv_cache_memory(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bytes or auto, got {value!r}") from None


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that fill an EngineConfig (shared by `pd generate` and `pd serve`)."""
    parser.add_argument("--model", required=True, type=Path, help="HF-format model directory (config.json, safetensors, tokenizer.json) or a .gguf file (config, tokenizer and weights read from it, dequantized at load)")
    parser.add_argument("--dtype", choices=(AUTO_DTYPE, *SUPPORTED_DTYPES), default=AUTO_DTYPE, help="weights and KV cache dtype; auto: the checkpoint's own (torch_dtype in config.json), and for a quantized .gguf bfloat16 where the device computes in it natively, else float32 (default auto)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=ENGINE_DEFAULTS["quantization"], help="gguf: linear layers (the tied lm_head included) computed from a quantized .gguf file's own Q8_0, Q5_0, Q4_K and Q6_K blocks, with activations quantized per 32 inputs as llama.cpp does (each in its own bits: Gemma 3 270M reads 253 MB a decode step against 536 MB in bfloat16); int8: every linear layer with int8 weights (per output channel) and its input rows quantized to int8 at run time (a second rounding of a GGUF's weights: 97.5%% top-1 agreement with transformers' bfloat16 on Gemma 3 270M); none: weights in --dtype; auto: gguf for a quantized .gguf served in bfloat16 by one CPU rank with AVX-512 VNNI and a C compiler, none otherwise, the choice printed at start (default %(default)s)")
    parser.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default=ENGINE_DEFAULTS["logprobs_mode"], help="the logits a sampled token's logprobs come from: processed, those it was chosen from (after a grammar's mask, logit_bias, the penalties and the min_tokens hold-back; before temperature, top-k/p and min-p); raw, the model's after a grammar's mask only (vLLM's default, raw_logprobs). The two agree for requests without bias or penalties; prefill and decode servers must share it (default %(default)s)")
    parser.add_argument("--device", default=ENGINE_DEFAULTS["device"], help="torch device, e.g. cpu or cuda:0 (default: cuda if present, else cpu)")
    parser.add_argument("--max-model-len", type=int, default=ENGINE_DEFAULTS["max_model_len"], help="longest sequence (prompt + output) served; default: the model's max_position_embeddings")
    parser.add_argument("--block-size", type=int, default=ENGINE_DEFAULTS["block_size"], help="tokens per KV cache block (raised for Mamba hybrids so a block holds a Mamba state; default 16)")
    parser.add_argument("--kv-cache-dtype", choices=tuple(KV_CACHE_DTYPES), default=ENGINE_DEFAULTS["kv_cache_dtype"], help="attention layers' KV cache: auto, the model's dtype; int8, each row (token and KV head) as int8 values and its own float32 scale (Gemma 3 270M: perplexity +0.1%%); fp8_e4m3, 8-bit floats with one scale, 1, as vLLM's fp8 without calibration (values saturate at +-448; perplexity +2.1%%). Either takes about half of bfloat16's bytes: nearly twice the tokens in --kv-cache-memory, half the bytes read by attention and moved from P to D. Mamba states stay in the model's dtype. Prefill and decode servers must agree: the handshake refuses another KV dtype (default %(default)s)")
    parser.add_argument("--kv-cache-memory", type=_kv_cache_memory, default=ENGINE_DEFAULTS["kv_cache_memory"], help="bytes of KV cache memory per rank, or auto: on a CPU a quarter of the memory available at start less the weights, on a GPU 90%% of its memory less what is in use and the weights, divided among tensor-parallel ranks, within 256 MiB..64 GiB and at most 4M tokens; $PD_KV_CACHE_MEMORY, where set, replaces auto; the size and its tokens are printed at start (default %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=ENGINE_DEFAULTS["max_num_seqs"], help="most requests in one batch (default %(default)s)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=ENGINE_DEFAULTS["max_num_batched_tokens"], help="most tokens computed in one step; longer prompts are prefilled in chunks. Smaller: requests arriving together see their first token sooner and decodes wait less behind prefills; larger: fewer steps per prefill (default %(default)s)")
    parser.add_argument("--reserve-growth-tokens", type=int, default=ENGINE_DEFAULTS["reserve_growth_tokens"], metavar="N", help="admit a request only while the KV cache still holds the next N tokens of every request holding blocks and of its own: with a tight cache, a request admitted only to be preempted as the others grow is recomputed for nothing; 0 admits whenever its prompt fits (default %(default)s)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=ENGINE_DEFAULTS["enable_prefix_caching"], help="reuse KV blocks of shared prompt prefixes (default on)")
    parser.add_argument("--kv-layout", choices=KV_LAYOUTS, default=ENGINE_DEFAULTS["kv_layout"], help="canonical: one cross-layer buffer, one byte range per block per group; per-layer: one buffer per layer slot (default %(default)s)")
    parser.add_argument("--no-hybrid-kv-cache", dest="hybrid_kv_cache", action="store_false", help="attention-only models: keep every attention layer's KV for all tokens in one group (sliding layers still attend within their window); refused for Mamba hybrids")
    parser.add_argument("--kv-connector", choices=[AUTO_CONNECTOR, *KV_CONNECTORS.names()], default=AUTO_CONNECTOR, help="move KV blocks between prefill and decode servers: nixl, or null to serve alone (default auto: nixl for --role prefill/decode, null for --role both)")
    parser.add_argument("--kv-host", default=ENGINE_DEFAULTS["kv_host"], help="address the KV side channel binds and advertises to decode servers (default %(default)s)")
    parser.add_argument("--kv-side-channel-port", type=int, default=ENGINE_DEFAULTS["kv_side_channel_port"], help="TCP port of the KV side channel (handshakes); 0 picks a free one (default %(default)s)")
    parser.add_argument("--kv-lease-seconds", type=float, default=ENGINE_DEFAULTS["kv_lease_seconds"], help="a prefill server frees KV blocks no decode server read after this long (default %(default)s)")
    parser.add_argument("--kv-digest", action=argparse.BooleanOptionalAction, default=ENGINE_DEFAULTS["kv_digest"], help="digest (xxh3-64) every KV block this server holds for a reader (a prefill server's blocks for its decode servers, a decode server's exported prefix for a prefill server), at the step that computed them, into the signed kv_transfer_params; a reader checks every byte it read against them before using or caching them, and a mismatch is a load failure (--kv-load-failure-policy; pd_kv_transfer_digest_mismatches_total). A reader checks whatever digests it is given, so turn it on where KV is held. Off by default on this project's CPU machine: it costs more than 2 %% of a transfer's time there (README, KV integrity) (default %(default)s)")
    parser.add_argument("--kv-read-timeout", type=float, default=ENGINE_DEFAULTS["kv_read_timeout"], help="on a decode server, a KV read from the prefill server still under way after this many seconds fails, and --kv-load-failure-policy decides (default %(default)s)")
    parser.add_argument("--kv-ucx-transports", default=ENGINE_DEFAULTS["kv_ucx_transports"], metavar="UCX_TLS", help="UCX transports the NIXL agent may use, as a UCX_TLS list (e.g. rc,ud,sm,self or cuda_ipc,sm,self,tcp); auto: for a loopback --kv-host sm,self,tcp (reads are one process_vm_readv copy), plus cuda_copy,cuda_ipc on a host with GPUs, else UCX's own choice; a UCX_TLS environment variable wins over auto (default %(default)s)")
    parser.add_argument("--no-skip-partial-groups-on-remote-prefill", dest="skip_partial_groups_on_remote_prefill", action="store_false", help="on a decode server, keep Mamba and sliding-window groups in the prefix-cache hit search for remote-prefill requests (A/B comparison: their misses collapse the full-attention hit, so D reads more)")
    parser.add_argument("--kv-load-failure-policy", choices=KV_LOAD_FAILURE_POLICIES, default=ENGINE_DEFAULTS["kv_load_failure_policy"], help="when a decode server cannot load a request's KV from the prefill server (P gone, read failed, incompatible pair): recompute the prompt here, or fail the request with an error (default %(default)s)")
    parser.add_argument("--kv-events-port", type=int, default=ENGINE_DEFAULTS["kv_events_port"], help="publish this server's prefix-cache changes (KV events: blocks stored, evicted, all cleared; msgpack, kv_events/) on a ZMQ PUB socket at tcp://--kv-events-host:PORT, for a KV-aware router (pd proxy --policy kv_aware); 0: any free port (and the replay socket too, unless --kv-events-replay-port), as GET /v1/kv_config says, where the proxy looks (default: off)")
    parser.add_argument("--kv-events-replay-port", type=int, default=ENGINE_DEFAULTS["kv_events_replay_port"], help="TCP port of the KV events' replay socket (ZMQ ROUTER: a subscriber that missed batches, or starts late, asks for them or for a snapshot) (default: --kv-events-port + 1; with --kv-events-port 0, any free port)")
    parser.add_argument("--kv-events-host", default=ENGINE_DEFAULTS["kv_events_host"], help="address the KV events sockets bind (default %(default)s)")
    parser.add_argument("--kv-max-held-fraction", type=float, default=ENGINE_DEFAULTS["kv_max_held_fraction"], help="on a prefill server, the most of its KV cache (0..1] kept for decode servers that have not read it yet; past it, new prefills for decode servers are refused with 503 and Retry-After so the server's own queue is not starved (default %(default)s)")
    parser.add_argument("--kv-transfer-secret", default=ENGINE_DEFAULTS["kv_transfer_secret"], help=f"secret shared by a deployment's prefill and decode servers: P signs the kv_transfer_params it returns, D acts only on signed, unexpired, unreplayed ones issued for the same prompt (403 otherwise); prefer the {SECRET_ENV} environment variable, which other users cannot read from the process list; an empty value means none, whatever the variable says (default: that variable; a prefill or decode server without one refuses to start unless --allow-unsigned-kv-params)")
    parser.add_argument("--allow-unsigned-kv-params", action="store_true", help="let a prefill or decode server start without a transfer secret: D then acts on unsigned kv_transfer_params naming a peer in --kv-allowed-peers, and keeps KV read under them out of its prefix cache (any client that reaches D can make it read any blocks of an allowed P); without this flag such a server refuses to start")
    parser.add_argument("--kv-allowed-peers", nargs="+", action="extend", default=None, metavar="NETWORK", help="without a secret, the prefill servers (IP addresses or networks) a decode server reads KV from; parameters naming another host get 403 and no connection; the flag may be repeated, each adding its networks (default: loopback, " + " ".join(DEFAULT_ALLOWED_PEERS) + ")")
    parser.add_argument("--num-threads", type=int, default=ENGINE_DEFAULTS["num_threads"], help="CPU threads the engine's torch ops use (default: torch's, one per core); when P and D share a machine, split its cores between them: oversubscribed threads spin and slow both")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=ENGINE_DEFAULTS["tensor_parallel_size"], help="shard the model over this many ranks, one process each (the engine starts them; torch.distributed, gloo on CPU): attention and Mamba heads, MLP channels and the vocabulary are split, each rank loads only its slices, and holds --kv-cache-memory of KV for its heads (default %(default)s)")
    parser.add_argument("--tp-timeout", type=float, default=ENGINE_DEFAULTS["tp_timeout"], help="seconds a tensor-parallel collective waits for the other ranks; a rank that died or hangs longer stops the engine (/health answers 503) (default %(default)s)")
    parser.add_argument("--tp-local-ranks", type=int, default=ENGINE_DEFAULTS["tp_local_ranks"], metavar="K", help="ranks this server starts on its own node, rank 0 included (ranks 0..K-1); ranks K..N-1 run on other nodes, each started there with `pd tp-rank --join HOST:PORT --rank R` and the same model path and secret, and join at --tp-host:--tp-port (default: all N here)")
    parser.add_argument("--tp-host", default=ENGINE_DEFAULTS["tp_host"], help="with --tp-local-ranks: the address ranks on other nodes join at, and where torch.distributed's store listens for them (torch's store listens on every interface: keep its port inside the cluster) (default %(default)s)")
    parser.add_argument("--tp-port", type=int, default=ENGINE_DEFAULTS["tp_port"], help="with --tp-local-ranks: the TCP port ranks on other nodes join at; a joining rank and this server prove to each other that they hold the deployment's secret (" + SECRET_ENV + ") before anything else is read (default: none)")
    parser.add_argument("--kv-offload-host-bytes", type=int, default=ENGINE_DEFAULTS["kv_offload_host_bytes"], metavar="BYTES", help="keep blocks of the prefix cache in this much host memory too (pinned for a GPU engine), written by a thread as blocks are cached (LRU); a prompt whose prefix left the KV cache loads it back from there, before the disk tier (default: no host tier)")
    parser.add_argument("--kv-offload-disk-path", type=Path, default=ENGINE_DEFAULTS["kv_offload_disk_path"], metavar="DIR", help="keep blocks of the prefix cache on local disk too, in a file under DIR written through NIXL's POSIX backend as blocks are cached (LRU); a prompt whose prefix left the KV cache but is on disk loads it back instead of computing it, checked block by block (CRC-32: a block that fails is a miss). A server restarted on the same DIR with the same model, layout, block size and dtype reuses it. Disk full, a read-only DIR or the file deleted: the tier turns itself off with a warning and serving goes on (default: no disk tier)")
    parser.add_argument("--kv-offload-disk-bytes", type=int, default=ENGINE_DEFAULTS["kv_offload_disk_bytes"], metavar="BYTES", help="size of the disk tier's file (taken as blocks are written) (default: a tenth of the free space under --kv-offload-disk-path, at most 64 GiB; where that is less than one block, or the path is not writable, the tier is off, saying why, and serving goes on; a size given that is less than one block is refused at start)")
    parser.add_argument("--seed", type=int, default=ENGINE_DEFAULTS["seed"], help="seed for requests that sample without their own seed (default %(default)s)")


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler takes of the engine's config and model, built by
    `EngineConfig.scheduler_config`; a field that is the engine's has the engine's
    default (tests build one directly)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    eos_token_ids: frozenset[int] = frozenset()
    mamba_block_size: int | None = None  # align prefill chunks to it (Mamba align mode)
    kv_load_failure_policy: str = ENGINE_DEFAULTS["kv_load_failure_policy"]  # a request whose remote KV fails to load
    kv_max_held_fraction: float = ENGINE_DEFAULTS["kv_max_held_fraction"]  # of all blocks, kept for decode servers
    skip_partial_groups_on_remote_prefill: bool = ENGINE_DEFAULTS["skip_partial_groups_on_remote_prefill"]
    reserve_growth_tokens: int = ENGINE_DEFAULTS["reserve_growth_tokens"]  # admit only while this many more fit

    def __post_init__(self) -> None:
        if self.reserve_growth_tokens < 0:
            raise ValueError(f"reserve_growth_tokens must not be negative, got {self.reserve_growth_tokens}")
        if not 0.0 < self.kv_max_held_fraction <= 1.0:
            raise ValueError(f"kv_max_held_fraction must be in (0, 1], got {self.kv_max_held_fraction}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {', '.join(KV_LOAD_FAILURE_POLICIES)}, "
                             f"got {self.kv_load_failure_policy!r}")
