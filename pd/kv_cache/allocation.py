"""Allocate the KV cache memory and give every layer its view of it.

Canonical layout (the default): one int8 buffer `(num_blocks, group_size * page)`;
layer i of every group views bytes `[i*page, i*page + real_page)` of each row. Per-layer
layout: `group_size` buffers `(num_blocks, page)`, layer i of every group views buffer i.
Views alias the buffers (no copies) and keep the block dimension leading, so block b of
a layer is always inside row b. `describe()` hands the same memory to connectors as
blocks and byte ranges (see `pd/kv_cache/canonical.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from pd.kv_cache.canonical import CanonicalKVCaches, KVCacheBlockDataRef, KVCacheBlockTensor
from pd.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    dtype_size,
)

KVLayout = Literal["canonical", "per-layer"]


@dataclass
class AttentionCache:
    """`kv`: (num_blocks, 2, block_size, num_kv_heads, head_size); index 0 is K, 1 is V."""

    kv: torch.Tensor


@dataclass
class MambaCache:
    """`conv`: (num_blocks, *conv_state_shape); `ssm`: (num_blocks, *ssm_state_shape)."""

    conv: torch.Tensor
    ssm: torch.Tensor


LayerCache = AttentionCache | MambaCache


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a spec dtype name; raises ValueError for an unknown name."""
    itemsize = dtype_size(name)  # raises the ValueError listing the known names
    dtype = getattr(torch, name)
    if dtype.itemsize != itemsize:
        raise ValueError(f"torch.{name} has {dtype.itemsize}-byte elements, the spec says {itemsize}")
    return dtype


@dataclass
class KVCacheAllocation:
    """The KV cache buffers (int8) and every layer's typed view into them."""

    buffers: list[torch.Tensor]
    layer_caches: dict[str, LayerCache]
    layout: KVLayout
    config: KVCacheConfig

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) block's data, every group and layer of it (a
        block id is one group's at a time, and its rows hold all of that group's data)."""
        if not pairs:
            return
        device = self.buffers[0].device
        sources = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=device)
        copies = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=device)
        for buffer in self.buffers:
            buffer[copies] = buffer[sources]

    def describe(self) -> CanonicalKVCaches:
        """The buffers as a connector sees them: block rows and per-group data refs."""
        tensors = [KVCacheBlockTensor(buf) for buf in self.buffers]
        page = self.config.page_size_bytes
        refs: list[list[KVCacheBlockDataRef]] = []
        for group in self.config.groups:
            n = len(group.layer_names)
            if self.layout == "canonical":
                refs.append([KVCacheBlockDataRef(tensor_idx=0, page_size_bytes=n * page)])
            else:
                refs.append([KVCacheBlockDataRef(tensor_idx=i, page_size_bytes=page) for i in range(n)])
        return CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


def allocate_kv_caches(
    config: KVCacheConfig,
    device: torch.device | str = "cpu",
    layout: KVLayout = "canonical",
) -> KVCacheAllocation:
    """Allocate zeroed KV cache memory for `config` in `layout` and view it per layer."""
    page = config.page_size_bytes
    if layout == "canonical":
        shape = (config.num_blocks, config.cross_layer_page_bytes)
        buffers = [torch.zeros(shape, dtype=torch.int8, device=device)]
    elif layout == "per-layer":
        shape = (config.num_blocks, page)
        buffers = [torch.zeros(shape, dtype=torch.int8, device=device) for _ in range(config.group_size)]
    else:
        raise ValueError(f"unknown KV cache layout {layout!r}; expected 'canonical' or 'per-layer'")
    layer_caches: dict[str, LayerCache] = {}
    for group in config.groups:
        for slot, name in enumerate(group.layer_names):
            if layout == "canonical":
                page_bytes = buffers[0][:, slot * page : (slot + 1) * page]
            else:
                page_bytes = buffers[slot]
            layer_caches[name] = _layer_cache(group.spec, page_bytes, name)
    return KVCacheAllocation(buffers=buffers, layer_caches=layer_caches, layout=layout, config=config)


def _layer_cache(spec: KVCacheSpec, page_bytes: torch.Tensor, name: str) -> LayerCache:
    """Typed views of one layer's page bytes `(num_blocks, page)`, an int8 slice of a buffer."""
    if isinstance(spec, FullAttentionSpec):  # sliding window included
        shape = (2, spec.block_size, spec.num_kv_heads, spec.head_size)
        return AttentionCache(kv=_typed_view(page_bytes, 0, spec.dtype, shape, name))
    if isinstance(spec, MambaSpec):
        conv = _typed_view(page_bytes, 0, spec.conv_dtype, spec.conv_state_shape, name)
        ssm = _typed_view(page_bytes, spec.ssm_offset_bytes, spec.ssm_dtype, spec.ssm_state_shape, name)
        return MambaCache(conv=conv, ssm=ssm)
    raise TypeError(f"layer {name!r}: no KV cache view for spec {type(spec).__name__}")


def _typed_view(
    page_bytes: torch.Tensor, offset: int, dtype_name: str, shape: tuple[int, ...], name: str
) -> torch.Tensor:
    """View bytes `[offset, offset + nbytes)` of every row as `(num_blocks, *shape)` of a dtype.

    Aliases the buffer: a slice, a dtype reinterpretation and a split of the last dim.
    """
    itemsize = dtype_size(dtype_name)
    nbytes = math.prod(shape) * itemsize
    if offset + nbytes > page_bytes.shape[1]:
        raise ValueError(f"layer {name!r}: {nbytes} bytes at offset {offset} overrun the {page_bytes.shape[1]}-byte page")
    raw = page_bytes[:, offset : offset + nbytes]
    row_stride, start = raw.stride(0), raw.storage_offset()
    if start % itemsize or row_stride % itemsize:
        raise ValueError(
            f"layer {name!r}: {dtype_name} data at buffer byte offset {start} with row stride "
            f"{row_stride} is not aligned to its {itemsize}-byte elements; pad the page size"
        )
    return raw.view(torch_dtype(dtype_name)).unflatten(1, shape)
