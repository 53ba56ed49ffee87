"""KV cache specs: what one layer keeps per block, as plain data.

A spec says how many tokens a block covers (`block_size`) and how many bytes one layer
keeps for one block (`page_size_bytes`). Layers with equal specs form one type; the
layout splits each type into KV cache groups (see `layout.py`). Dtypes are names
(`"float32"`, `"bfloat16"`, ...) so this package needs no torch.
"""

from __future__ import annotations

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


# Attention rows in these dtypes carry a float32 scale after their head_size values (per
# token and KV head): int8 K/V are round(x / scale), scale = max|x| / 127 of the row.
ROW_SCALE_BYTES: dict[str, int] = {"int8": 4}


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
    """K and V for `block_size` tokens: page bytes = 2 * block_size * heads * head_size * itemsize.

    A page is ordered by KV head, outermost: head h's K and V for the block's tokens are
    one range of `head_page_bytes` (see `pd/kv_cache/row_order.py`)."""

    num_kv_heads: int
    head_size: int
    dtype: str

    def __post_init__(self) -> None:
        dtype_size(self.dtype)
        if self.num_kv_heads <= 0 or self.head_size <= 0:
            raise ValueError(f"num_kv_heads and head_size must be positive in {self!r}")
        super().__post_init__()

    @property
    def row_bytes(self) -> int:
        """One token's K (or V) of one head: head_size values, and a scale where the dtype
        has one (ROW_SCALE_BYTES)."""
        return self.head_size * dtype_size(self.dtype) + ROW_SCALE_BYTES.get(self.dtype, 0)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.row_bytes

    @property
    def head_page_bytes(self) -> int:
        """One KV head's K and V for one block: `2 * block_size` rows."""
        return 2 * self.block_size * self.row_bytes

    @property
    def real_page_size_bytes(self) -> int:
        return self.num_kv_heads * self.head_page_bytes


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
    a block covers `block_size` tokens like an attention block. The model's conv state
    is `(conv_dim, conv_width)`, its channels `[x: num_heads * head_dim][B: n_groups *
    state_size][C: n_groups * state_size]`; the SSM state is `(num_heads, head_dim,
    state_size)`. A page holds them ordered by Mamba group, then head (see
    `pd/kv_cache/row_order.py`): per group its B and C conv state (`group_shared_bytes`),
    then per head its SSM state and x conv state (`head_page_bytes`), each part aligned
    to the larger of the two dtypes.
    """

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_width: int  # d_conv - 1: the inputs the conv state keeps
    conv_dtype: str
    ssm_dtype: str

    def __post_init__(self) -> None:
        dtype_size(self.conv_dtype)
        dtype_size(self.ssm_dtype)
        dims = (self.num_heads, self.head_dim, self.state_size, self.n_groups, self.conv_width)
        if any(d <= 0 for d in dims):
            raise ValueError(f"Mamba dimensions must be positive in {self!r}")
        if self.num_heads % self.n_groups:
            raise ValueError(f"{self.n_groups} groups do not split {self.num_heads} heads in {self!r}")
        super().__post_init__()

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.num_heads * self.head_dim + 2 * self.n_groups * self.state_size, self.conv_width)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.state_size)

    @property
    def _align(self) -> int:
        return max(dtype_size(self.conv_dtype), dtype_size(self.ssm_dtype))

    @property
    def group_shared_bytes(self) -> int:
        """One Mamba group's B and C conv state, `(2, state_size, conv_width)`, padded."""
        return round_up(2 * self.state_size * self.conv_width * dtype_size(self.conv_dtype), self._align)

    @property
    def ssm_head_bytes(self) -> int:
        """One head's SSM state `(head_dim, state_size)`, padded: the x conv state follows it."""
        return round_up(self.head_dim * self.state_size * dtype_size(self.ssm_dtype), self._align)

    @property
    def head_page_bytes(self) -> int:
        """One head's SSM state and x conv state `(head_dim, conv_width)`, padded."""
        x_conv = self.head_dim * self.conv_width * dtype_size(self.conv_dtype)
        return self.ssm_head_bytes + round_up(x_conv, self._align)

    @property
    def real_page_size_bytes(self) -> int:
        return self.n_groups * self.group_shared_bytes + self.num_heads * self.head_page_bytes


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share block ids: block b of this group holds, for each of these layers,
    that layer's page of block b. In the per-layer layout layer i of every group shares
    tensor slot i; in the canonical one the group's layers share the block's row."""

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
