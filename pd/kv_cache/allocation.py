"""Allocate the KV cache memory and give every layer its view of it.

Canonical layout (the default): one int8 buffer `(num_blocks, group_size * page)`; a
group's data for block b is one region at the start of row b, all its layers in it,
ordered heads outermost (`pd/kv_cache/row_order.py`). Per-layer layout: `group_size`
buffers `(num_blocks, page)`, layer i of every group in buffer i, its page ordered the
same way. Views alias the buffers (no copies, strided where heads are outermost) and
keep the block dimension leading, so block b of a layer is always inside row b.
`describe()` hands the same memory to connectors as blocks, byte ranges and the pieces
(heads) a range holds (see `pd/kv_cache/canonical.py`).
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from pd.kv_cache import row_order
from pd.kv_cache.canonical import CanonicalKVCaches, KVCacheBlockDataRef, KVCacheBlockTensor
from pd.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    dtype_size,
)

KVLayout = Literal["canonical", "per-layer"]


@dataclass
class AttentionCache:
    """`kv`: (num_blocks, 2, block_size, num_kv_heads, head_size); index 0 is K, 1 is V.
    A strided view: in memory the head is outermost (`pd/kv_cache/row_order.py`)."""

    kv: torch.Tensor


@dataclass
class MambaCache:
    """One Mamba2 layer's state, viewed in its row order (Mamba group, then head):
    `conv_bc` (num_blocks, groups, 2, state, conv width) holds B (0) and C (1) of the
    conv state; `conv_x` (num_blocks, groups, heads per group, head dim, conv width)
    its x channels; `ssm` (num_blocks, groups, heads per group, head dim, state).
    `read` and `write` speak the model's shapes."""

    conv_x: torch.Tensor
    conv_bc: torch.Tensor
    ssm: torch.Tensor

    def read(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 copies of blocks' states: conv (n, conv_dim, conv width) with channels
        [x | B | C], and SSM (n, heads, head dim, state)."""
        bc = self.conv_bc[blocks].float()
        conv = torch.cat([self.conv_x[blocks].float().flatten(1, 3), bc[:, :, 0].flatten(1, 2),
                          bc[:, :, 1].flatten(1, 2)], dim=1)
        return conv, self.ssm[blocks].float().flatten(1, 2)

    def write(self, blocks: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Store states of the shapes `read` returns into `blocks`."""
        groups, per_group, head_dim, _ = self.conv_x.shape[1:]
        state = self.conv_bc.shape[3]
        x, b, c = conv.split([groups * per_group * head_dim, groups * state, groups * state], dim=1)
        self.conv_x[blocks] = x.unflatten(1, (groups, per_group, head_dim)).to(self.conv_x.dtype)
        self.conv_bc[blocks] = torch.stack([b.unflatten(1, (groups, state)), c.unflatten(1, (groups, state))],
                                           dim=2).to(self.conv_bc.dtype)
        self.ssm[blocks] = ssm.unflatten(1, (groups, per_group)).to(self.ssm.dtype)


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

    @property
    def nbytes(self) -> int:
        """The KV cache memory this worker holds (with tensor parallelism: its heads)."""
        return sum(buffer.nbytes for buffer in self.buffers)

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

    def describe(self, first_heads: Sequence[tuple[int, int]] | None = None) -> CanonicalKVCaches:
        """The buffers as a connector sees them: block rows, per-group data refs and the
        pieces of each. `first_heads[g]`: the global index of group g's first head and
        first Mamba group on this worker (a tensor-parallel rank's); zeros by default."""
        tensors = [KVCacheBlockTensor(buf) for buf in self.buffers]
        page = self.config.page_size_bytes
        refs: list[list[KVCacheBlockDataRef]] = []
        group_pieces = []
        for group in self.config.groups:
            n = len(group.layer_names)
            if self.layout == "canonical":
                refs.append([KVCacheBlockDataRef(tensor_idx=0, page_size_bytes=n * page)])
            else:
                refs.append([KVCacheBlockDataRef(tensor_idx=i, page_size_bytes=page) for i in range(n)])
            first_head, first_group = first_heads[len(group_pieces)] if first_heads else (0, 0)
            group_pieces.append(row_order.pieces(group.spec, _layers_per_region(self.layout, group),
                                                 first_head, first_group))
        return CanonicalKVCaches(tensors=tensors, group_data_refs=refs, group_pieces=group_pieces)


def _zeros(shape: tuple[int, int], device: torch.device | str) -> torch.Tensor:
    """Zeroed int8 memory. On a CPU, pages of an anonymous map: the kernel hands them out
    zeroed as they are first touched, so a large cache costs neither a fill at start
    (2 GiB: ~1 s) nor memory it has not used yet."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=torch.int8, device=device)
    pages = mmap.mmap(-1, max(shape[0] * shape[1], 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.int8, count=shape[0] * shape[1]).view(shape)  # holds `pages`


def allocate_kv_caches(
    config: KVCacheConfig,
    device: torch.device | str = "cpu",
    layout: KVLayout = "canonical",
) -> KVCacheAllocation:
    """Allocate zeroed KV cache memory for `config` in `layout` and view it per layer."""
    page = config.page_size_bytes
    if layout == "canonical":
        shape = (config.num_blocks, config.cross_layer_page_bytes)
        buffers = [_zeros(shape, device)]
    elif layout == "per-layer":
        shape = (config.num_blocks, page)
        buffers = [_zeros(shape, device) for _ in range(config.group_size)]
    else:
        raise ValueError(f"unknown KV cache layout {layout!r}; expected 'canonical' or 'per-layer'")
    layer_caches: dict[str, LayerCache] = {}
    for group in config.groups:
        layers = _layers_per_region(layout, group)
        for slot, name in enumerate(group.layer_names):
            region = _Region(buffers[0], layers, slot) if layout == "canonical" else _Region(buffers[slot], layers, 0)
            layer_caches[name] = _layer_cache(group.spec, region)
    return KVCacheAllocation(buffers=buffers, layer_caches=layer_caches, layout=layout, config=config)


def _layers_per_region(layout: KVLayout, group: KVCacheGroup) -> int:
    """Layers of a group sharing one region of a row: all of them in the canonical
    buffer, one per buffer in the per-layer layout."""
    return len(group.layer_names) if layout == "canonical" else 1


@dataclass(frozen=True)
class _Region:
    """Layer `layer` of a group whose `num_layers` layers share a region at the start of
    each row of `buffer` (int8, rows back to back)."""

    buffer: torch.Tensor
    num_layers: int
    layer: int

    def view(self, dtype_name: str, offset: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> torch.Tensor:
        """`(num_blocks, *shape)` elements of a dtype, the first at byte `offset` of each
        row, `strides` in bytes; aliases the buffer."""
        itemsize = dtype_size(dtype_name)
        row = self.buffer.shape[1]
        if row % itemsize or offset % itemsize or any(s % itemsize for s in strides):
            raise ValueError(f"{dtype_name} data at byte {offset} (strides {strides}, rows of {row} bytes) "
                             f"is not aligned to its {itemsize}-byte elements")
        typed = self.buffer.view(torch_dtype(dtype_name))
        return typed.as_strided((self.buffer.shape[0], *shape), (row // itemsize, *(s // itemsize for s in strides)),
                                typed.storage_offset() + offset // itemsize)


def _layer_cache(spec: KVCacheSpec, region: _Region) -> LayerCache:
    """Typed views of one layer's data in its region, in the row order of `row_order.py`."""
    layers, i = region.num_layers, region.layer
    head = row_order.head_stride(spec, layers)
    if isinstance(spec, FullAttentionSpec):  # sliding window included
        bs, row, item = spec.block_size, spec.row_bytes, dtype_size(spec.dtype)
        shape = (2, bs, spec.num_kv_heads, row // item)  # an int8 row's last 4 bytes: its float32 scale
        return AttentionCache(kv=region.view(spec.dtype, i * spec.head_page_bytes, shape, (bs * row, row, head, item)))
    if isinstance(spec, MambaSpec):
        groups, per_group = spec.n_groups, spec.num_heads // spec.n_groups
        n, w, p = spec.state_size, spec.conv_width, spec.head_dim
        c, s = dtype_size(spec.conv_dtype), dtype_size(spec.ssm_dtype)
        stride = row_order.mamba_group_stride(spec, layers)
        heads_at = layers * spec.group_shared_bytes + i * spec.head_page_bytes
        return MambaCache(
            conv_x=region.view(spec.conv_dtype, heads_at + spec.ssm_head_bytes, (groups, per_group, p, w),
                               (stride, head, w * c, c)),
            conv_bc=region.view(spec.conv_dtype, i * spec.group_shared_bytes, (groups, 2, n, w),
                                (stride, n * w * c, w * c, c)),
            ssm=region.view(spec.ssm_dtype, heads_at, (groups, per_group, p, n), (stride, head, n * s, s)))
    raise TypeError(f"no KV cache view for spec {type(spec).__name__}")
