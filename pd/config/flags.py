"""The flags that fill an EngineConfig (`pd serve`, `pd generate`): one per setting, named
by its flat name (pd/config/engine.py), its default the setting's own."""

from __future__ import annotations

import argparse
from pathlib import Path

from pd.config.engine import EngineConfig, flat_default, flat_names
from pd.config.settings import (
    KV_CACHE_DTYPES,
    KV_LAYOUTS,
    KV_LOAD_FAILURE_POLICIES,
    LOGPROBS_MODES,
    QUANTIZATIONS,
    STEP_LIMITS,
)
from pd.kv_transfer.connectors import AUTO_CONNECTOR, KV_CONNECTORS
from pd.kv_transfer.signing import DEFAULT_ALLOWED_PEERS, SECRET_ENV
from pd.models.model_config import AUTO_DTYPE, SUPPORTED_DTYPES


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The config from parsed flags (those `add_engine_flags` defines), not yet resolved."""
    names = flat_names()
    return EngineConfig.from_flat(**{k: v for k, v in vars(args).items() if k in names and v is not None})


def _kv_cache_memory(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bytes or auto, got {value!r}") from None


def max_step_ms_arg(value: str) -> float | str:
    """--max-step-ms: milliseconds, auto or off (pd serve, pd bench simulate fit)."""
    if value in STEP_LIMITS:
        return value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds, auto or off, got {value!r}") from None


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that fill an EngineConfig (shared by `pd generate` and `pd serve`), one
    help section per group of settings."""
    _model_flags(parser.add_argument_group("the model and how it is computed"))
    _cache_flags(parser.add_argument_group("the KV cache"))
    _scheduler_flags(parser.add_argument_group("the batch, admission and remote KV"))
    _transfer_flags(parser.add_argument_group("moving KV between servers"))
    _parallel_flags(parser.add_argument_group("tensor parallelism and threads"))
    _offload_flags(parser.add_argument_group("the KV offload tiers"))
    _telemetry_flags(parser.add_argument_group("KV events for a KV-aware router"))


def _model_flags(group: argparse._ArgumentGroup) -> None:
    """The flags of the model and how it is computed (ModelSettings)."""
    group.add_argument("--model", required=True, type=Path,
                       help="HF-format model directory (config.json, safetensors, tokenizer.json) or a .gguf file "
                            "(config, tokenizer and weights read from it, dequantized at load)")
    group.add_argument("--dtype", choices=(AUTO_DTYPE, *SUPPORTED_DTYPES), default=flat_default("dtype"),
                       help="weights and KV cache dtype; auto: the checkpoint's own (torch_dtype in config.json), and"
                            " for a quantized .gguf bfloat16 where the device computes in it natively, else float32 "
                            "(default auto)")
    group.add_argument("--quantization", choices=QUANTIZATIONS, default=flat_default("quantization"),
                       help="gguf: linear layers (the tied lm_head included) computed from a quantized .gguf file's "
                            "own Q8_0, Q5_0, Q4_K and Q6_K blocks, with activations quantized per 32 inputs as "
                            "llama.cpp does (each in its own bits: Gemma 3 270M reads 253 MB a decode step against "
                            "536 MB in bfloat16); int8: every linear layer with int8 weights (per output channel) and"
                            " its input rows quantized to int8 at run time (a second rounding of a GGUF's weights: "
                            "97.5%% top-1 agreement with transformers' bfloat16 on Gemma 3 270M); none: weights in "
                            "--dtype; auto: gguf for a quantized .gguf served in bfloat16 by one CPU rank with "
                            "AVX-512 VNNI and a C compiler, none otherwise, the choice printed at start (default "
                            "%(default)s)")
    group.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default=flat_default("logprobs_mode"),
                       help="the logits a sampled token's logprobs come from: processed, those it was chosen from "
                            "(after a grammar's mask, logit_bias, the penalties and the min_tokens hold-back; before "
                            "temperature, top-k/p and min-p); raw, the model's after a grammar's mask only (vLLM's "
                            "default, raw_logprobs). The two agree for requests without bias or penalties; prefill "
                            "and decode servers must share it (default %(default)s)")
    group.add_argument("--device", default=flat_default("device"),
                       help="torch device, e.g. cpu or cuda:0 (default: cuda if present, else cpu)")
    group.add_argument("--max-model-len", type=int, default=flat_default("max_model_len"),
                       help="longest sequence (prompt + output) served; default: the model's max_position_embeddings")
    group.add_argument("--seed", type=int, default=flat_default("seed"),
                       help="seed for requests that sample without their own seed (default %(default)s)")


def _cache_flags(group: argparse._ArgumentGroup) -> None:
    """The flags of the KV cache (CacheSettings)."""
    group.add_argument("--block-size", type=int, default=flat_default("block_size"),
                       help="tokens per KV cache block (raised for Mamba hybrids so a block holds a Mamba state; "
                            "default 16)")
    group.add_argument("--kv-cache-dtype", choices=tuple(KV_CACHE_DTYPES), default=flat_default("kv_cache_dtype"),
                       help="attention layers' KV cache: auto, the model's dtype; int8, each row (token and KV head) "
                            "as int8 values and its own float32 scale (Gemma 3 270M: perplexity +0.1%%); fp8_e4m3, "
                            "8-bit floats with one scale, 1, as vLLM's fp8 without calibration (values saturate at "
                            "+-448; perplexity +2.1%%). Either takes about half of bfloat16's bytes: nearly twice the"
                            " tokens in --kv-cache-memory, half the bytes read by attention and moved from P to D. "
                            "Mamba states stay in the model's dtype. Prefill and decode servers must agree: the "
                            "handshake refuses another KV dtype (default %(default)s)")
    group.add_argument("--kv-cache-memory", type=_kv_cache_memory, default=flat_default("kv_cache_memory"),
                       help="bytes of KV cache memory per rank, or auto: on a CPU a quarter of the memory available "
                            "at start less the weights, on a GPU 90%% of its memory less what is in use and the "
                            "weights, divided among tensor-parallel ranks, within 256 MiB..64 GiB and at most 4M "
                            "tokens; $PD_KV_CACHE_MEMORY, where set, replaces auto; the size and its tokens are "
                            "printed at start (default %(default)s)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=flat_default("enable_prefix_caching"),
                       help="reuse KV blocks of shared prompt prefixes (default on)")
    group.add_argument("--kv-layout", choices=KV_LAYOUTS, default=flat_default("kv_layout"),
                       help="canonical: one cross-layer buffer, one byte range per block per group; per-layer: one "
                            "buffer per layer slot (default %(default)s)")
    group.add_argument("--no-hybrid-kv-cache", dest="hybrid_kv_cache", action="store_false",
                       help="attention-only models: keep every attention layer's KV for all tokens in one group "
                            "(sliding layers still attend within their window); refused for Mamba hybrids")


def _scheduler_flags(group: argparse._ArgumentGroup) -> None:
    """The flags of the batch, admission and remote KV (SchedulerSettings)."""
    group.add_argument("--max-num-seqs", type=int, default=flat_default("max_num_seqs"),
                       help="most requests in one batch (default %(default)s)")
    group.add_argument("--max-num-batched-tokens", type=int, default=flat_default("max_num_batched_tokens"),
                       help="most tokens computed in one step; longer prompts are prefilled in chunks. Larger: "
                            "prompts arriving together start together, in fewer steps; beside decoding streams "
                            "--max-step-ms bounds a step anyway (default %(default)s)")
    group.add_argument("--max-step-ms", type=max_step_ms_arg, default=flat_default("max_step_ms"), metavar="MS",
                       help="while streams are decoding, give a step only as many prompt tokens as keep it within "
                            "MS milliseconds (the cost of a step is learnt from the steps taken), so that a prefill "
                            "does not stall running streams; auto: twice the time of the decodes alone; off: every "
                            "step may take --max-num-batched-tokens. A step without decodes, one in which at least as "
                            "many requests wait to compute their prompts as are decoding, and the first steps are "
                            "not limited (default %(default)s)")
    group.add_argument("--reserve-growth-tokens", type=int, default=flat_default("reserve_growth_tokens"), metavar="N",
                       help="admit a request only while the KV cache still holds the next N tokens of every request "
                            "holding blocks and of its own: with a tight cache, a request admitted only to be "
                            "preempted as the others grow is recomputed for nothing; 0 admits whenever its prompt "
                            "fits (default %(default)s)")
    group.add_argument("--no-skip-partial-groups-on-remote-prefill", dest="skip_partial_groups_on_remote_prefill",
                       action="store_false",
                       help="on a decode server, keep Mamba and sliding-window groups in the prefix-cache hit search "
                            "for remote-prefill requests (A/B comparison: their misses collapse the full-attention "
                            "hit, so D reads more)")
    group.add_argument("--kv-load-failure-policy", choices=KV_LOAD_FAILURE_POLICIES,
                       default=flat_default("kv_load_failure_policy"),
                       help="when a decode server cannot load a request's KV from the prefill server (P gone, read "
                            "failed, incompatible pair): recompute the prompt here, or fail the request with an error"
                            " (default %(default)s)")
    group.add_argument("--kv-max-held-fraction", type=float, default=flat_default("kv_max_held_fraction"),
                       help="on a prefill server, the most of its KV cache (0..1] kept for decode servers that have "
                            "not read it yet; past it, new prefills for decode servers are refused with 503 and "
                            "Retry-After so the server's own queue is not starved (default %(default)s)")


def _transfer_flags(group: argparse._ArgumentGroup) -> None:
    """The flags of moving KV between servers (TransferSettings)."""
    group.add_argument("--kv-connector", choices=[AUTO_CONNECTOR, *KV_CONNECTORS.names()],
                       default=flat_default("kv_connector"),
                       help="move KV blocks between prefill and decode servers: nixl, or null to serve alone (default"
                            " auto: nixl for --role prefill/decode, null for --role both)")
    group.add_argument("--kv-host", default=flat_default("kv_host"),
                       help="address the KV side channel binds and advertises to decode servers (default %(default)s)")
    group.add_argument("--kv-side-channel-port", type=int, default=flat_default("kv_side_channel_port"),
                       help="TCP port of the KV side channel (handshakes); 0 picks a free one (default %(default)s)")
    group.add_argument("--kv-lease-seconds", type=float, default=flat_default("kv_lease_seconds"),
                       help="a prefill server frees KV blocks no decode server read after this long (default "
                            "%(default)s)")
    group.add_argument("--kv-digest", action=argparse.BooleanOptionalAction, default=flat_default("kv_digest"),
                       help="digest (xxh3-64) every KV block this server holds for a reader (a prefill server's "
                            "blocks for its decode servers, a decode server's exported prefix for a prefill server), "
                            "at the step that computed them, into the signed kv_transfer_params; a reader checks "
                            "every byte it read against them before using or caching them, and a mismatch is a load "
                            "failure (--kv-load-failure-policy; pd_kv_transfer_digest_mismatches_total). A reader "
                            "checks whatever digests it is given, so turn it on where KV is held. Off by default on "
                            "this project's CPU machine: it costs more than 2 %% of a transfer's time there (README, "
                            "KV integrity) (default %(default)s)")
    group.add_argument("--kv-read-timeout", type=float, default=flat_default("kv_read_timeout"),
                       help="on a decode server, a KV read from the prefill server still under way after this many "
                            "seconds fails, and --kv-load-failure-policy decides (default %(default)s)")
    group.add_argument("--kv-ucx-transports", default=flat_default("kv_ucx_transports"), metavar="UCX_TLS",
                       help="UCX transports the NIXL agent may use, as a UCX_TLS list (e.g. rc,ud,sm,self or "
                            "cuda_ipc,sm,self,tcp); auto: for a loopback --kv-host sm,self,tcp (reads are one "
                            "process_vm_readv copy), plus cuda_copy,cuda_ipc on a host with GPUs, else UCX's own "
                            "choice; a UCX_TLS environment variable wins over auto (default %(default)s)")
    group.add_argument("--kv-transfer-secret", default=flat_default("kv_transfer_secret"),
                       help=f"secret shared by a deployment's prefill and decode servers: P signs the "
                            f"kv_transfer_params it returns, D acts only on signed, unexpired, unreplayed ones issued "
                            f"for the same prompt (403 otherwise); prefer the {SECRET_ENV} environment variable, which"
                            f" other users cannot read from the process list; an empty value means none, whatever the "
                            f"variable says (default: that variable; a prefill or decode server without one refuses to"
                            f" start unless --allow-unsigned-kv-params)")
    group.add_argument("--allow-unsigned-kv-params", action="store_true",
                       help="let a prefill or decode server start without a transfer secret: D then acts on unsigned "
                            "kv_transfer_params naming a peer in --kv-allowed-peers, and keeps KV read under them out"
                            " of its prefix cache (any client that reaches D can make it read any blocks of an "
                            "allowed P); without this flag such a server refuses to start")
    group.add_argument("--kv-allowed-peers", nargs="+", action="extend", default=None, metavar="NETWORK",
                       help="the peers (IP addresses or networks) this server moves KV with, both ways: the servers "
                            "a decode server reads KV from (parameters naming another host get 403 and no connection)"
                            ", and the readers whose side-channel handshakes a server answers (a handshake from "
                            "another address is refused, and with it the NIXL metadata needed to read this server's "
                            "KV); the flag may be repeated, each adding its networks (default: without a secret, "
                            "loopback, " + " ".join(DEFAULT_ALLOWED_PEERS) + "; with one, any host whose handshake "
                            "proves the secret)")


def _parallel_flags(group: argparse._ArgumentGroup) -> None:
    """The flags of tensor parallelism and threads (ParallelSettings)."""
    group.add_argument("--num-threads", type=int, default=flat_default("num_threads"),
                       help="CPU threads the engine's torch ops use (default: torch's, one per core); when P and D "
                            "share a machine, split its cores between them: oversubscribed threads spin and slow both")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=flat_default("tensor_parallel_size"),
                       help="shard the model over this many ranks, one process each (the engine starts them; "
                            "torch.distributed, gloo on CPU): attention and Mamba heads, MLP channels and the "
                            "vocabulary are split, each rank loads only its slices, and holds --kv-cache-memory of KV"
                            " for its heads (default %(default)s)")
    group.add_argument("--tp-timeout", type=float, default=flat_default("tp_timeout"),
                       help="seconds a tensor-parallel collective waits for the other ranks; a rank that died or "
                            "hangs longer stops the engine (/health answers 503) (default %(default)s)")
    group.add_argument("--tp-local-ranks", type=int, default=flat_default("tp_local_ranks"), metavar="K",
                       help="ranks this server starts on its own node, rank 0 included (ranks 0..K-1); ranks K..N-1 "
                            "run on other nodes, each started there with `pd tp-rank --join HOST:PORT --rank R` and "
                            "the same model path and secret, and join at --tp-host:--tp-port (default: all N here)")
    group.add_argument("--tp-host", default=flat_default("tp_host"),
                       help="with --tp-local-ranks: the address ranks on other nodes join at, and where "
                            "torch.distributed's store listens for them (torch's store listens on every interface: "
                            "keep its port inside the cluster) (default %(default)s)")
    group.add_argument("--tp-port", type=int, default=flat_default("tp_port"),
                       help="with --tp-local-ranks: the TCP port ranks on other nodes join at; a joining rank and "
                            "this server prove to each other that they hold the deployment's secret (" + SECRET_ENV
                            + ") before anything else is read (default: none)")


def _offload_flags(group: argparse._ArgumentGroup) -> None:
    """The flags of the KV offload tiers (OffloadSettings)."""
    group.add_argument("--kv-offload-host-bytes", type=int, default=flat_default("kv_offload_host_bytes"),
                       metavar="BYTES",
                       help="keep blocks of the prefix cache in this much host memory too (pinned for a GPU engine), "
                            "written by a thread as blocks are cached (LRU); a prompt whose prefix left the KV cache "
                            "loads it back from there, before the disk tier (default: no host tier)")
    group.add_argument("--kv-offload-disk-path", type=Path, default=flat_default("kv_offload_disk_path"),
                       metavar="DIR",
                       help="keep blocks of the prefix cache on local disk too, in a file under DIR written through "
                            "NIXL's POSIX backend as blocks are cached (LRU); a prompt whose prefix left the KV cache"
                            " but is on disk loads it back instead of computing it, checked block by block (CRC-32: a"
                            " block that fails is a miss). A server restarted on the same DIR with the same model, "
                            "layout, block size and dtype reuses it. Disk full, a read-only DIR or the file deleted: "
                            "the tier turns itself off with a warning and serving goes on (default: no disk tier)")
    group.add_argument("--kv-offload-disk-bytes", type=int, default=flat_default("kv_offload_disk_bytes"),
                       metavar="BYTES",
                       help="size of the disk tier's file (taken as blocks are written) (default: a tenth of the free"
                            " space under --kv-offload-disk-path, at most 64 GiB; where that is less than one block, "
                            "or the path is not writable, the tier is off, saying why, and serving goes on; a size "
                            "given that is less than one block is refused at start)")


def _telemetry_flags(group: argparse._ArgumentGroup) -> None:
    """The flags of KV events for a KV-aware router (TelemetrySettings)."""
    group.add_argument("--kv-events-port", type=int, default=flat_default("kv_events_port"),
                       help="publish this server's prefix-cache changes (KV events: blocks stored, evicted, all "
                            "cleared; msgpack, kv_events/) on a ZMQ PUB socket at tcp://--kv-events-host:PORT, for a "
                            "KV-aware router (pd proxy --policy kv_aware); 0: any free port (and the replay socket "
                            "too, unless --kv-events-replay-port), as GET /v1/kv_config says, where the proxy looks "
                            "(default: off)")
    group.add_argument("--kv-events-replay-port", type=int, default=flat_default("kv_events_replay_port"),
                       help="TCP port of the KV events' replay socket (ZMQ ROUTER: a subscriber that missed batches, "
                            "or starts late, asks for them or for a snapshot) (default: --kv-events-port + 1; with "
                            "--kv-events-port 0, any free port)")
    group.add_argument("--kv-events-host", default=flat_default("kv_events_host"),
                       help="address the KV events sockets bind (default %(default)s)")
