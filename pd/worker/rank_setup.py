"""Building one rank's model and model runner from an `EngineConfig`: what the engine
core does for rank 0 and every other tensor-parallel rank does for itself
(`pd/worker/tp_ranks.py`), so that all ranks build alike."""

from __future__ import annotations

import functools
import json
import logging

import torch

from pd.config import EngineConfig
from pd.contracts.connector_api import ConnectorContext, KVConnectorWorker, NullConnectorWorker
from pd.distributed.shard import TPShard
from pd.kv_cache.layout import KVCacheLayoutError, make_kv_cache_config
from pd.kv_cache.spec import KVCacheConfig, KVCacheSpec, MambaSpec
from pd.kv_transfer.compat import compat_hash
from pd.models.base import CausalLM
from pd.models.fingerprint import weights_fingerprint
from pd.models.gguf_linear import quantize_gguf_linears
from pd.models.loader import load_model, model_skeleton
from pd.models.model_config import ModelConfig
from pd.models.packed import pack_linears
from pd.models.quantized import quantize_linears
from pd.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def build_model(config: EngineConfig, shard: TPShard, device: str) -> tuple[ModelConfig, CausalLM]:
    """The rank's shard of the model, loaded, quantized (int8, or computed from the GGUF's
    blocks: the linears left by gguf are packed) or packed."""
    model_config = ModelConfig.from_dir(config.model.path, config.model.dtype, config.model.max_model_len, tp=shard,
                                        kv_cache_dtype=config.cache.attention_kv_dtype)
    model = load_model(model_config, device)
    if config.model.quantization == "int8":
        quantize_linears(model)
    else:
        if config.model.quantization == "gguf":
            used = quantize_gguf_linears(model)
            logger.info("gguf: linear layers computed from %s blocks", ", ".join(f"{k} ({n})" for k, n in used.items()))
        pack_linears(model)
    model.gguf_sources.clear()  # the file's blocks are packed or dequantized by now
    if torch.device(device).type == "cpu":
        build_kernels()
    return model_config, model


def build_kernels() -> None:
    """Build (or find built) the attention and fused kernels now, at start, rather than in
    the first request's step: on an empty kernel cache (a fresh install) that is ~2 s of
    compiling the first users would wait for. The linear kernels are built at load."""
    from pd.attention import cpu_kernels
    from pd.models import fused

    cpu_kernels.build()
    fused.build()


@functools.lru_cache(maxsize=8)  # the engine's context, its KV cache and its runner each ask
def whole_kv_cache_config(config: EngineConfig) -> KVCacheConfig:
    """The KV cache groups of the whole (unsharded) model, from its skeleton on the meta
    device: what a block means whatever the tensor-parallel size (the compatibility hash
    is taken of it), and the block sizes every rank of every TP size uses."""
    model_config = ModelConfig.from_dir(config.model.path, config.model.dtype, config.model.max_model_len,
                                        kv_cache_dtype=config.cache.attention_kv_dtype)
    specs = model_skeleton(model_config).kv_cache_specs(config.cache.block_size, hybrid=config.cache.hybrid)
    return make_kv_cache_config(specs, 1 << 62)  # the groups and block sizes; no memory is taken


def connector_context(config: EngineConfig, engine_id: str) -> ConnectorContext:
    """What every rank's connector half is built from (rank 0's; a rank > 0 replaces the
    rank): the compatibility hash and block sizes are the whole model's, equal on P and
    D whatever their tensor-parallel sizes."""
    model_config = ModelConfig.from_dir(config.model.path, config.model.dtype, config.model.max_model_len)
    whole = whole_kv_cache_config(config)
    model_id = json.dumps(model_config.hf_config, sort_keys=True, default=str)
    groups = [repr(g.spec) + repr(g.layer_names) for g in whole.groups]
    hashed = compat_hash(model_id, weights_fingerprint(config.model.path), config.model.quantization,
                         config.model.dtype, whole.block_sizes, config.cache.layout, groups)
    return ConnectorContext(engine_id, config.transfer.connector_config(), hashed, whole.block_sizes,
                            tp_size=config.parallel.size)


def kv_cache_config(config: EngineConfig, model_config: ModelConfig, model: CausalLM) -> KVCacheConfig:
    """The KV cache of one rank: `kv_cache_memory` bytes of its heads' blocks. Every
    rank of an engine has the same shapes, so the same number of blocks; every TP size
    the whole model's block sizes (a hybrid's block size is raised until an attention
    page holds a Mamba state, and sharding changes the two unequally), so that servers
    of different TP sizes exchange blocks of the same tokens."""
    if model_config.tp.size == 1:
        specs = model.kv_cache_specs(config.cache.block_size, hybrid=config.cache.hybrid)
        return _capped(config, specs, model_config.context_len)
    block_sizes = whole_kv_cache_config(config).block_sizes
    specs = model.kv_cache_specs(max(block_sizes), hybrid=config.cache.hybrid)
    rank = _capped(config, specs, model_config.context_len)
    if rank.block_sizes != block_sizes:
        raise KVCacheLayoutError(
            f"tensor-parallel size {model_config.tp.size} shards this model's KV into blocks of {rank.block_sizes} "
            f"tokens where the whole model's are {block_sizes}: servers of other TP sizes could not read them; "
            f"raise --block-size to {max(rank.block_sizes)} on every server of the deployment")
    return rank


def _capped(config: EngineConfig, specs: dict[str, KVCacheSpec], context_len: int) -> KVCacheConfig:
    """`kv_cache_memory` bytes of blocks, fewer where they would hold more than
    `kv_cache_max_tokens` (an automatic size on a small model: blocks no workload reaches
    cost start-up time and memory)."""
    kv = make_kv_cache_config(specs, config.cache.memory, context_len)
    cap = config.cache.max_tokens
    if cap is not None and kv.num_blocks * max(kv.block_sizes) > cap:
        kv = make_kv_cache_config(specs, config.cache.memory * cap // (kv.num_blocks * max(kv.block_sizes)),
                                  context_len)
    return kv


def first_heads(whole: KVCacheConfig, shard: TPShard) -> list[tuple[int, int]]:
    """Per KV cache group, the global index of the first head and Mamba group a rank
    holds, by the rules the model shards by: KV heads split or, fewer than ranks,
    replicated (`attention_projections`); Mamba heads split, Mamba groups split or
    replicated (`Mamba2Mixer`)."""
    out = []
    for group in whole.groups:
        spec = group.spec
        if isinstance(spec, MambaSpec):
            out.append((shard.split(spec.num_heads, "Mamba heads")[0],
                        shard.replicated_split(spec.n_groups, "Mamba groups")[0]))
        else:
            out.append((shard.replicated_split(spec.num_kv_heads, "KV heads")[0], 0))
    return out


def build_runner(config: EngineConfig, model_config: ModelConfig, model: CausalLM, device: str | torch.device,
                 connector: KVConnectorWorker | None = None, keep_logits: bool = False) -> ModelRunner:
    heads = first_heads(whole_kv_cache_config(config), model_config.tp) if model_config.tp.size > 1 else None
    return ModelRunner(model, kv_cache_config(config, model_config, model), max_num_reqs=config.scheduler.max_num_seqs,
                       max_model_len=model_config.context_len, device=device, layout=config.cache.layout,
                       keep_logits=keep_logits, connector=connector or NullConnectorWorker(),
                       eos_token_ids=frozenset(model_config.eos_token_ids), logprobs_mode=config.model.logprobs_mode,
                       first_heads=heads)
