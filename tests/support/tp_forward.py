"""One tensor-parallel rank running a model directly (no engine): its sharded weights, its
own KV cache, one prefill and a few decode steps; the logits of each step."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from pd.attention.backend import CommonAttentionMetadata
from pd.attention.group import make_attention_groups
from pd.distributed.shard import TPShard
from pd.forward_context import ForwardContext, set_forward_context
from pd.kv_cache.allocation import allocate_kv_caches
from pd.kv_cache.layout import make_kv_cache_config
from pd.models.loader import load_model
from pd.models.model_config import ModelConfig

BLOCKS = 64


def rank_logits(model: Path, shard: TPShard, prompt: list[int], decode: list[int], port: int,
                quantization: str | None = None) -> tuple[list[torch.Tensor], int]:
    """Logits of the prompt's last token, then of each `decode` token fed one at a time;
    and the bytes of the rank's parameters."""
    if shard.size > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=shard.rank, world_size=shard.size)
    torch.set_num_threads(1)
    try:
        return _run(model, shard, prompt, decode, quantization)
    finally:
        if shard.size > 1:
            dist.destroy_process_group()


def _run(model_dir: Path, shard: TPShard, prompt: list[int], decode: list[int],
         quantization: str | None) -> tuple[list[torch.Tensor], int]:
    config = ModelConfig.from_dir(model_dir, "float32", tp=shard)
    model = load_model(config)
    weight_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    if quantization == "int8":
        from pd.models.quantized import quantize_linears
        quantize_linears(model)
    specs = model.kv_cache_specs(16)
    probe = make_kv_cache_config(specs, 1 << 30)
    kv = make_kv_cache_config(specs, BLOCKS * probe.cross_layer_page_bytes)
    caches = allocate_kv_caches(kv)
    groups = make_attention_groups(model.kv_cache_layers(), kv, "cpu")
    tokens = list(prompt)
    rows = [list(range(1 + g * (BLOCKS // len(kv.groups)), (g + 1) * (BLOCKS // len(kv.groups))))
            for g in range(len(kv.groups))]
    out = []
    computed, new = 0, list(prompt)
    for step in range(len(decode) + 1):
        common = [CommonAttentionMetadata.from_requests([row], [computed], [len(new)], spec.spec.block_size)
                  for row, spec in zip(rows, kv.groups)]
        metadata = {name: group.builder.build(common[group.kv_cache_group_id])
                    for group in groups for name in group.layer_names}
        positions = torch.arange(computed, computed + len(new))
        with torch.inference_mode(), set_forward_context(ForwardContext(metadata, caches.layer_caches)):
            hidden = model(torch.tensor(new), positions)
            out.append(model.compute_logits(hidden[-1:])[0].float())
        computed += len(new)
        if step < len(decode):
            new = [decode[step]]
            tokens.append(decode[step])
    return out, weight_bytes
