"""Attention groups: the layers of one KV cache group that share one metadata builder.

A KV cache group says which blocks hold a layer's state; an attention group says how
the layer reads them. They usually coincide, but not always: in non-hybrid mode one
full-attention KV cache group holds both full and sliding-window layers, which need
different metadata, so it has two attention groups. Metadata is built once per
attention group per step and shared by its layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pd.attention.backend import CommonAttentionMetadata
from pd.attention.layer import Attention
from pd.attention.mamba_metadata import build_mamba_metadata
from pd.kv_cache.spec import KVCacheConfig, MambaSpec


class MambaMetadataBuilder:
    """Builds the Mamba layers' metadata (state blocks to read and write)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = device

    def build(self, common: CommonAttentionMetadata) -> Any:
        return build_mamba_metadata(common, self.device)


@dataclass
class AttentionGroup:
    kv_cache_group_id: int
    backend: str  # an attention backend name, or "mamba"
    sliding_window: int | None
    builder: Any  # .build(CommonAttentionMetadata) -> metadata
    layer_names: list[str] = field(default_factory=list)


def make_attention_groups(layers: dict[str, nn.Module], config: KVCacheConfig,
                          device: torch.device | str) -> list[AttentionGroup]:
    """One attention group per (KV cache group, backend, sliding window), in layer order."""
    groups: dict[tuple[int, str, int | None], AttentionGroup] = {}
    for name, layer in layers.items():
        group_id, _ = config.layer_slot(name)
        mamba = isinstance(config.groups[group_id].spec, MambaSpec)
        if not mamba and not isinstance(layer, Attention):
            raise TypeError(f"layer {name!r} ({type(layer).__name__}) has no attention backend")
        key = (group_id, "mamba", None) if mamba else (group_id, layer.backend.name, layer.sliding_window)
        if key not in groups:
            builder = MambaMetadataBuilder(device) if mamba else layer.backend.builder_cls()(layer.sliding_window,
                                                                                             device)
            groups[key] = AttentionGroup(key[0], key[1], key[2], builder)
        groups[key].layer_names.append(name)
    return list(groups.values())
