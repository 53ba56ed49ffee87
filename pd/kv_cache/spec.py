"""KV cache specs: what one layer keeps per block, as plain data.

A spec says how many tokens a block covers (`block_size`) and how many bytes one layer
keeps for one block (`page_size_bytes`). Layers with equal specs form one type; the
layout splits each type into KV cache groups (see `layout.py`). Dtypes are names
(`"float32"`, `"bfloat16"`, ...) so this package needs no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


def dtype_size(dtype: str) -> int:
    """Bytes per element of a dtype name; raises ValueError for an unknown name."""
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        known = ", ".join(sorted(DTYPE_SIZES))
        raise ValueError(f"unknown KV cache dtype {dtype!r}; known: {known}") from None


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """Base of all specs. `page_size_padded`, when set, is the page size after the
    layout unified page sizes across groups; it is never smaller than the real page."""

    block_size: int
    page_size_padded: int | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise ValueError(
                f"page_size_padded={self.page_size_padded} is smaller than the real page "
                f"size {self.real_page_size_bytes} of {type(self).__name__}"
            )

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes of data one layer keeps for one block, before padding."""
        raise NotImplementedError

    @property
    def page_size_bytes(self) -> int:
        """Bytes one layer's slot takes in a block: the real page, padded if unified."""
        return self.page_size_padded or self.real_page_size_bytes


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(KVCacheSpec):
    """K and V for `block_size` tokens: page bytes = 2 * block_size * heads * head_size * itemsize."""

    num_kv_heads: int
    head_size: int
    dtype: str

    def __post_init__(self) -> None:
        dtype_size(self.dtype)
        if self.num_kv_heads <= 0 or self.head_size <= 0:
            raise ValueError(f"num_kv_heads and head_size must be positive in {self!r}")
        super().__post_init__()

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_size * dtype_size(self.dtype)

    @property
    def real_page_size_bytes(self) -> int:
        return self.block_size * self.bytes_per_token


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Attention over the last `sliding_window` tokens: a token attends to itself and
    the `sliding_window - 1` tokens before it. Same page as full attention."""

    sliding_window: int

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {self.sliding_window}")
        super().__post_init__()


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """Mamba2 state of one layer: the causal-conv state and the SSM state.

    In align mode a Mamba block holds the state after the last token of its block, so
    a block covers `block_size` tokens like an attention block. Within a page the conv
    state comes first, the SSM state follows at `ssm_offset_bytes`.
    """

    conv_state_shape: tuple[int, ...]
    ssm_state_shape: tuple[int, ...]
    conv_dtype: str
    ssm_dtype: str

    def __post_init__(self) -> None:
        dtype_size(self.conv_dtype)
        dtype_size(self.ssm_dtype)
        if any(d <= 0 for d in (*self.conv_state_shape, *self.ssm_state_shape)):
            raise ValueError(f"Mamba state shapes must be positive in {self!r}")
        super().__post_init__()

    @property
    def conv_state_bytes(self) -> int:
        return math.prod(self.conv_state_shape) * dtype_size(self.conv_dtype)

    @property
    def ssm_state_bytes(self) -> int:
        return math.prod(self.ssm_state_shape) * dtype_size(self.ssm_dtype)

    @property
    def ssm_offset_bytes(self) -> int:
        """The SSM state starts at the first offset after the conv state aligned to its dtype."""
        return round_up(self.conv_state_bytes, dtype_size(self.ssm_dtype))

    @property
    def real_page_size_bytes(self) -> int:
        return self.ssm_offset_bytes + self.ssm_state_bytes


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share block ids: block b of this group holds, for each of these layers,
    that layer's page of block b. Layer i of every group shares tensor slot i."""

    spec: KVCacheSpec
    layer_names: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.layer_names:
            raise ValueError("a KV cache group needs at least one layer")


@dataclass(frozen=True)
class KVCacheTensor:
    """Slot i of every block row: one page per block, shared by layer i of every group."""

    size_bytes: int
    shared_by: tuple[str, ...]


@dataclass(frozen=True)
class KVCacheConfig:
    """The whole KV cache: groups drawing from one pool of `num_blocks` blocks.

    Block 0 is the null block (a placeholder for positions a group no longer needs), so
    `num_blocks - 1` blocks are usable. Every group has one page size.
    """

    num_blocks: int
    groups: tuple[KVCacheGroup, ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a KV cache config needs at least one group")
        pages = {g.spec.page_size_bytes for g in self.groups}
        if len(pages) != 1:
            raise ValueError(f"all KV cache groups must have one page size, got {sorted(pages)}")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (null block + 1), got {self.num_blocks}")
        names = [name for g in self.groups for name in g.layer_names]
        if len(names) != len(set(names)):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"layers in more than one KV cache group: {dup}")

    @property
    def page_size_bytes(self) -> int:
        """Bytes one layer keeps for one block; the same in every group."""
        return self.groups[0].spec.page_size_bytes

    @property
    def block_sizes(self) -> list[int]:
        """Tokens per block, per group."""
        return [g.spec.block_size for g in self.groups]

    @property
    def group_size(self) -> int:
        """Layers per group (the largest group): the number of page slots in a block row."""
        return max(len(g.layer_names) for g in self.groups)

    @property
    def cross_layer_page_bytes(self) -> int:
        """Bytes of one block row of the canonical buffer: `group_size` pages."""
        return self.group_size * self.page_size_bytes

    @property
    def tensors(self) -> tuple[KVCacheTensor, ...]:
        """Slot i of every block: shared by layer i of every group that has an i-th layer."""
        return tuple(
            KVCacheTensor(
                size_bytes=self.num_blocks * self.page_size_bytes,
                shared_by=tuple(g.layer_names[i] for g in self.groups if i < len(g.layer_names)),
            )
            for i in range(self.group_size)
        )

    def layer_slot(self, layer_name: str) -> tuple[int, int]:
        """(group id, slot index) of a layer."""
        for group_id, group in enumerate(self.groups):
            if layer_name in group.layer_names:
                return group_id, group.layer_names.index(layer_name)
        raise KeyError(f"layer {layer_name!r} is in no KV cache group")
