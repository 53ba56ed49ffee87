"""The descriptors of one NIXL READ of KV blocks: one (address, length, device id) row
per run per data ref, on each side, where a run is a maximal sequence of positions whose
local AND remote block ids both go up by one. Canonical layout (one ref per group) gives
one descriptor per run; per-layer layout one per run per layer.

Between workers that hold different heads (tensor parallelism of different sizes on P
and D), `piece_runs` matches the two layouts' pieces (`pd/kv_cache/row_order.py`) into
runs of bytes within a ref, and a READ has one descriptor per block per run: with heads
outermost in a block, one per block per pair of ranks, never one per layer.

They are built per transfer (`initialize_xfer`) rather than prepped once per block and
picked by index (`make_prepped_xfer`): measured DRAM->DRAM between two processes, both
ran at the same bandwidth (6.0 GB/s for 1003 blocks of 64 KiB in 3 runs, 4.2-4.3 GB/s for
4075 blocks of 4 KiB), because NIXL merges adjacent descriptors of a prepped transfer
itself (telemetry: 3 descriptors for 1003 block indices). Per-transfer lists cost
O(runs x refs) per READ and need no O(blocks x refs) descriptor lists per peer prepared
and kept."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from connectors.nixl.peer_messages import DataRefInfo, KVLayoutInfo, PieceInfo, TensorInfo
from pd.kv_cache.row_order import Piece, PieceKey, transfer_runs

NULL_BLOCK_ID = 0


Run = tuple[int, int, int]  # (remote offset, local offset, bytes) within a ref


def piece_runs(ours: Sequence[Sequence[PieceInfo]], theirs: Sequence[Sequence[PieceInfo]],
               taken: list[set[PieceKey]]) -> list[list[Run]] | None:
    """Per group, the runs that fill our pieces from the peer's, leaving out pieces in
    `taken[g]` (read from another peer already; those read here are added). None when
    the peer holds exactly our pieces where we do (the same heads): whole refs move, and
    runs of blocks coalesce. ValueError when a piece differs in size."""
    if not ours or not theirs:
        return None
    if [list(g) for g in ours] == [list(g) for g in theirs]:
        for pieces, seen in zip(ours, taken):
            seen.update((p.kind, p.index) for p in pieces)
        return None
    if len(ours) != len(theirs):
        raise ValueError(f"pieces for {len(theirs)} remote groups, {len(ours)} here")
    return [transfer_runs(_pieces(t), _pieces(o), seen) for o, t, seen in zip(ours, theirs, taken)]


def _pieces(infos: Sequence[PieceInfo]) -> tuple[Piece, ...]:
    return tuple(Piece((p.kind, p.index), p.offset, p.nbytes) for p in infos)


def read_descriptors(tensors: Sequence[TensorInfo], refs: Sequence[Sequence[DataRefInfo]], peer: KVLayoutInfo,
                     local_ids: list[list[int]], remote_ids: list[list[int]],
                     runs: list[list[Run]] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The READ of `remote_ids` of the peer into `local_ids` here (per KV cache group,
    positional), as (address, length, device id) rows of uint64 arrays, local and remote
    aligned: row i of both is one run of blocks of one data ref, or with `runs`
    (`piece_runs`) one run of bytes of one block of one ref. ValueError for ids out of
    range or lists that do not match the groups."""
    if len(local_ids) != len(refs) or len(remote_ids) != len(refs):
        raise ValueError(f"block ids for {len(local_ids)} local and {len(remote_ids)} remote groups; "
                         f"the KV cache has {len(refs)}")
    local, remote = [], []
    for group_id, (lids, rids) in enumerate(zip(local_ids, remote_ids)):
        if len(lids) != len(rids):
            raise ValueError(f"group {group_id}: {len(lids)} local block ids for {len(rids)} remote ones")
        lids, rids = np.asarray(lids, dtype=np.int64), np.asarray(rids, dtype=np.int64)
        check_ids(lids, tensors[0].num_blocks, f"group {group_id} local")
        check_ids(rids, peer.tensors[0].num_blocks, f"group {group_id} remote")
        if runs is not None:
            pairs = paired_blocks(lids, rids)
            for ours, theirs in zip(refs[group_id], peer.group_data_refs[group_id]):
                local.append(piece_ranges(tensors[ours.tensor_idx], ours, pairs[0], runs[group_id], 1))
                remote.append(piece_ranges(peer.tensors[theirs.tensor_idx], theirs, pairs[1], runs[group_id], 0))
            continue
        l_starts, r_starts, lengths = paired_run_arrays(lids, rids)
        for ours, theirs in zip(refs[group_id], peer.group_data_refs[group_id]):
            local.append(run_ranges(tensors[ours.tensor_idx], ours, l_starts, lengths))
            remote.append(run_ranges(peer.tensors[theirs.tensor_idx], theirs, r_starts, lengths))
    empty = np.empty((0, 3), dtype=np.uint64)
    return np.concatenate([empty, *local]), np.concatenate([empty, *remote])


def paired_runs(local_ids: Sequence[int], remote_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(local start, remote start, length) of each maximal run of positions where both ids
    go up by one, in order. Positions where either id is the null block are skipped."""
    return [tuple(int(x) for x in run) for run in zip(*paired_run_arrays(local_ids, remote_ids))]


def paired_run_arrays(local_ids: Sequence[int], remote_ids: Sequence[int]) -> tuple[np.ndarray, ...]:
    """`paired_runs` as three int64 arrays (local starts, remote starts, lengths), built
    without a Python loop over the blocks: a request can hold thousands."""
    local, remote = np.asarray(local_ids, dtype=np.int64), np.asarray(remote_ids, dtype=np.int64)
    if local.shape != remote.shape:
        raise ValueError(f"{local.size} local block ids for {remote.size} remote ones")
    real = (local != NULL_BLOCK_ID) & (remote != NULL_BLOCK_ID)
    local, remote = local[real], remote[real]
    breaks = np.ones(local.size, dtype=bool)
    breaks[1:] = (np.diff(local) != 1) | (np.diff(remote) != 1)
    starts = np.flatnonzero(breaks)
    return local[starts], remote[starts], np.diff(np.append(starts, local.size))


def paired_blocks(local_ids: np.ndarray, remote_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (local, remote) block ids of the positions where neither is the null block."""
    real = (local_ids != NULL_BLOCK_ID) & (remote_ids != NULL_BLOCK_ID)
    return local_ids[real], remote_ids[real]


def piece_ranges(tensor: TensorInfo, ref: DataRefInfo, blocks: np.ndarray, runs: Sequence[Run],
                 side: int) -> np.ndarray:
    """One (address, length, device id) row per block per run: the run's bytes at its
    offset on `side` (0: remote, 1: local) in the ref of each block, blocks outermost."""
    offsets = np.asarray([run[side] for run in runs], dtype=np.int64)
    sizes = np.asarray([run[2] for run in runs], dtype=np.int64)
    ranges = np.empty((blocks.size * offsets.size, 3), dtype=np.uint64)
    ranges[:, 0] = (tensor.base_address + blocks[:, None] * tensor.row_bytes + ref.offset_bytes
                    + offsets[None, :]).reshape(-1)
    ranges[:, 1] = np.tile(sizes, blocks.size)
    ranges[:, 2] = tensor.device_id
    return ranges


def check_ids(ids: np.ndarray, num_blocks: int, what: str) -> None:
    bad = np.flatnonzero((ids < 0) | (ids >= num_blocks))
    if bad.size:
        raise ValueError(f"{what} block id {ids[bad[0]]} out of range [0, {num_blocks})")


def run_ranges(tensor: TensorInfo, ref: DataRefInfo, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """One (address, length, device id) row per run (start, n): rows start..start+n-1
    from the ref's offset in the first to the end of its page in the last (as
    block_ranges)."""
    row = tensor.row_bytes
    ranges = np.empty((starts.size, 3), dtype=np.uint64)
    ranges[:, 0] = tensor.base_address + starts * row + ref.offset_bytes
    ranges[:, 1] = (lengths - 1) * row + ref.page_size_bytes
    ranges[:, 2] = tensor.device_id
    return ranges
