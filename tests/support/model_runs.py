"""One prompt through a loaded model, outside the engine: a KV cache of its own, the
attention metadata, the forward context."""

from __future__ import annotations

import torch

from pd.attention import get_attention_backend
from pd.attention.backend import CommonAttentionMetadata
from pd.attention.layer import Attention
from pd.attention.mamba_metadata import build_mamba_metadata
from pd.forward_context import ForwardContext, set_forward_context
from pd.kv_cache.allocation import allocate_kv_caches
from pd.kv_cache.layout import make_kv_cache_config
from pd.kv_cache.spec import KVCacheConfig, cdiv
from pd.models.base import CausalLM

BLOCK_SIZE = 16


def run_prompt(model: CausalLM, token_ids: torch.Tensor, hybrid: bool = True) -> torch.Tensor:
    """Logits (T, vocab) for one request's whole prompt, computed in one step."""
    n = len(token_ids)
    specs = model.kv_cache_specs(BLOCK_SIZE, hybrid=hybrid)
    probe = make_kv_cache_config(specs, 1 << 40)  # only for the unified block sizes and row bytes
    blocks = sum(cdiv(n, g.spec.block_size) for g in probe.groups)
    config = make_kv_cache_config(specs, (blocks + 1) * probe.cross_layer_page_bytes)
    caches = allocate_kv_caches(config)
    common, first = [], 1
    for group_id, group in enumerate(config.groups):  # groups must not share block ids
        common.append(_request_metadata(group_id, config, n, first))
        first += cdiv(n, group.spec.block_size)
    metadata = {}
    for name, layer in model.kv_cache_layers().items():
        group_common = common[config.layer_slot(name)[0]]
        if isinstance(layer, Attention):
            builder = get_attention_backend("torch").builder_cls()(layer.sliding_window, torch.device("cpu"))
            metadata[name] = builder.build(group_common)
        else:
            metadata[name] = build_mamba_metadata(group_common, "cpu")
    with torch.no_grad(), set_forward_context(ForwardContext(metadata, caches.layer_caches)):
        return model.compute_logits(model(token_ids, torch.arange(n)))


def _request_metadata(group_id: int, config: KVCacheConfig, num_tokens: int,
                      first_block: int) -> CommonAttentionMetadata:
    """One request with no cached tokens computing `num_tokens` tokens, its blocks in
    this group numbered from `first_block`."""
    bs = config.groups[group_id].spec.block_size
    blocks = torch.arange(first_block, first_block + cdiv(num_tokens, bs), dtype=torch.int32)
    positions = torch.arange(num_tokens)
    return CommonAttentionMetadata(
        query_start_loc_cpu=[0, num_tokens], num_computed_tokens_cpu=[0], seq_lens_cpu=[num_tokens],
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_table=blocks[None], slot_mapping=blocks[positions // bs].long() * bs + positions % bs,
        block_size=bs)
