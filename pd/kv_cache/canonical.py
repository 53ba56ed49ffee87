"""How a worker's KV cache memory is described to a connector: blocks and bytes.

The canonical layout is ONE int8 buffer of shape `(num_blocks, group_size * page)`.
A group's data for block b (all its layers) is one region at the start of row b, so
one block of one group is one contiguous byte range, and consecutive block ids are
adjacent rows: a run of blocks is one range. Described canonically, that is one
tensor (the whole buffer) and, per group, one data ref
`(tensor_idx=0, page_size_bytes=len(group.layer_names) * page, offset_bytes=0)`.

The per-layer layout keeps `group_size` buffers (slot i = tensor i, each
`(num_blocks, page)`, layer i of every group); each group then has one ref per layer,
`(tensor_idx=i, page_size_bytes=page, offset_bytes=0)`.

Either way a connector registers the tensors and moves the byte ranges that
`CanonicalKVCaches.block_ranges` yields; it never looks at layers or dtypes. Where two
workers hold different heads (tensor parallelism of different sizes), `group_pieces`
says which bytes of a group's ref hold which head (and, for Mamba, which group's shared
conv state): heads are outermost (`pd/kv_cache/row_order.py`), so a worker's share of
another's block is one range per ref.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pd.kv_cache.row_order import Piece


@dataclass(frozen=True)
class KVCacheBlockTensor:
    """An int8 tensor `(num_blocks, page_size_in_bytes)`, block dimension leading.

    Rows are contiguous and back to back (row stride == row length), so block b starts
    at `base_address + b * page_size_in_bytes`.
    """

    tensor: torch.Tensor

    def __post_init__(self) -> None:
        t = self.tensor
        if t.dtype != torch.int8:
            raise ValueError(f"a KV cache block tensor must be int8, got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"a KV cache block tensor must be 2-D (blocks, bytes), got shape {tuple(t.shape)}")
        if t.shape[1] == 0 or t.stride(1) != 1:
            raise ValueError(f"block rows must be non-empty and contiguous, got strides {t.stride()}")
        if t.shape[0] > 1 and t.stride(0) != t.shape[1]:
            raise ValueError(
                f"row stride {t.stride(0)} must equal the row length {t.shape[1]} "
                "(blocks back to back)"
            )

    @property
    def num_blocks(self) -> int:
        return self.tensor.shape[0]

    @property
    def page_size_in_bytes(self) -> int:
        return self.tensor.shape[1]

    @property
    def base_address(self) -> int:
        return self.tensor.data_ptr()

    @property
    def device(self) -> torch.device:
        return self.tensor.device


@dataclass(frozen=True)
class KVCacheBlockDataRef:
    """Where one group's data lives in a block row of tensor `tensor_idx`:
    bytes `[offset_bytes, offset_bytes + page_size_bytes)` of the row."""

    tensor_idx: int
    page_size_bytes: int
    offset_bytes: int = 0

    def __post_init__(self) -> None:
        if self.tensor_idx < 0 or self.page_size_bytes <= 0 or self.offset_bytes < 0:
            raise ValueError(f"invalid KV cache block data ref {self!r}")


@dataclass(frozen=True)
class CanonicalKVCaches:
    """A worker's KV cache as a connector sees it: tensors of block rows, and per KV
    cache group (outer list) the refs saying where that group's bytes are in a row.

    A connector never needs the model: it sees blocks and byte ranges only. All tensors
    have the same number of blocks; block id b of any group is row b of its tensors.
    `group_pieces[g]`, when given, names the parts of every ref of group g (offsets from
    the ref's start); empty when the bytes are not described by head.
    """

    tensors: list[KVCacheBlockTensor]
    group_data_refs: list[list[KVCacheBlockDataRef]]
    group_pieces: list[tuple[Piece, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.tensors:
            raise ValueError("CanonicalKVCaches needs at least one tensor")
        counts = {t.num_blocks for t in self.tensors}
        if len(counts) != 1:
            raise ValueError(f"all KV cache tensors must have one number of blocks, got {sorted(counts)}")
        for group_id, refs in enumerate(self.group_data_refs):
            if not refs:
                raise ValueError(f"group {group_id} has no data refs")
            for ref in refs:
                self._check_ref(group_id, ref)
        if self.group_pieces:
            self._check_pieces()

    def _check_pieces(self) -> None:
        if len(self.group_pieces) != len(self.group_data_refs):
            raise ValueError(f"{len(self.group_pieces)} piece lists for {len(self.group_data_refs)} groups")
        for group_id, (refs, pieces) in enumerate(zip(self.group_data_refs, self.group_pieces)):
            size = min(ref.page_size_bytes for ref in refs)
            if any(p.offset < 0 or p.nbytes <= 0 or p.offset + p.nbytes > size for p in pieces):
                raise ValueError(f"group {group_id}: a piece runs outside its {size}-byte ref")

    def _check_ref(self, group_id: int, ref: KVCacheBlockDataRef) -> None:
        if ref.tensor_idx >= len(self.tensors):
            raise ValueError(f"group {group_id}: {ref!r} names tensor {ref.tensor_idx} of {len(self.tensors)}")
        row = self.tensors[ref.tensor_idx].page_size_in_bytes
        if ref.offset_bytes + ref.page_size_bytes > row:
            raise ValueError(f"group {group_id}: {ref!r} runs past the row of {row} bytes")

    @property
    def num_blocks(self) -> int:
        return self.tensors[0].num_blocks

    def block_ranges(self, group_id: int, block_ids: Sequence[int]) -> list[tuple[int, int]]:
        """(address, length) byte ranges holding `block_ids` of group `group_id`.

        The ids keep the order given; only adjacent ascending ids (b, b+1, ...) coalesce
        into one run. Per data ref, a run of n ids starting at b is one range
        `(base + b*row + offset, (n-1)*row + page_size_bytes)`, so when the ref covers
        the whole row the run is n*row contiguous bytes. Ranges are grouped by ref, then
        by run.
        """
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise IndexError(f"block id {b} out of range [0, {self.num_blocks})")
        runs = _runs(block_ids)
        ranges: list[tuple[int, int]] = []
        for ref in self.group_data_refs[group_id]:
            tensor = self.tensors[ref.tensor_idx]
            row = tensor.page_size_in_bytes
            for start, n in runs:
                addr = tensor.base_address + start * row + ref.offset_bytes
                ranges.append((addr, (n - 1) * row + ref.page_size_bytes))
        return ranges


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """(first id, length) of each run of adjacent ascending ids, in the order given."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs
