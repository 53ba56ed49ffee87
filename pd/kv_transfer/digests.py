"""Digests of KV blocks, so that a reader checks every byte it read from another server
against what that server held when it computed them (`--kv-digest`).

A digest is xxh3-64 (xxhash) of one unit of one block of one KV cache group: a unit is a
piece of the group's bytes (a KV head, or a Mamba group's shared part: `group_pieces`,
pd/kv_cache/row_order.py), its bytes in every data ref of the group in ref order; a group
whose bytes are not described by piece is one unit, each ref's whole page. Pieces are
what tensor-parallel ranks of any size exchange, and two ranks holding the same piece
hold the same bytes: a reader checks every piece it read, whichever rank it read it from.

The holder's digests of a request (one blob per tensor-parallel rank) are 8 bytes per
(group, position, unit of that rank), in that order, little-endian; 0 at a position of
the null block. Every position has its digests, so that a block the holder gives up
between digesting and handing out its parameters (a sliding window's) shifts nothing.

On a CPU KV cache the digests read the blocks where they are. On a GPU one each unit is
copied to host memory first (not measured on a GPU yet; `--kv-digest` is off by default).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from pd.kv_cache.canonical import CanonicalKVCaches, KVCacheBlockDataRef

DIGEST_BYTES = 8
WHOLE = ("page", 0)  # the key of the one unit of a group not described by piece

Unit = tuple[tuple[str, int], int, int]  # (piece key, offset in each ref, bytes)


class BlockDigests:
    """Digests of this worker's blocks (its own heads of them, under tensor parallelism)."""

    def __init__(self, kv_caches: CanonicalKVCaches) -> None:
        self.kv_caches = kv_caches
        pieces = kv_caches.group_pieces or [()] * len(kv_caches.group_data_refs)
        self.units: list[list[Unit]] = [
            [(p.key, p.offset, p.nbytes) for p in group] if group
            else [(WHOLE, 0, min(r.page_size_bytes for r in refs))]
            for refs, group in zip(kv_caches.group_data_refs, pieces)]
        self._rows = [_host_rows(t.tensor) for t in kv_caches.tensors]

    def unit_keys(self, group: int) -> list[tuple[str, int]]:
        return [key for key, _, _ in self.units[group]]

    def digest(self, group: int, block: int, unit: int) -> int:
        """xxh3-64 of unit `unit` of block `block` of group `group`."""
        _, offset, nbytes = self.units[group][unit]
        refs = self.kv_caches.group_data_refs[group]
        if len(refs) == 1:
            return xxhash.xxh3_64_intdigest(self._bytes(refs[0], block, offset, nbytes))
        state = xxhash.xxh3_64()
        for ref in refs:
            state.update(self._bytes(ref, block, offset, nbytes))
        return state.intdigest()

    def request(self, block_ids: Sequence[Sequence[int]]) -> bytes:
        """The digests of a request's blocks (positional per group; 0: none there), in the
        order readers find them by (`expected`)."""
        out = []
        for group, ids in enumerate(block_ids):
            units = range(len(self.units[group]))
            for block in ids:
                out.extend(self.digest(group, block, unit) if block else 0 for unit in units)
        return np.asarray(out, dtype="<u8").tobytes()

    def _bytes(self, ref: KVCacheBlockDataRef, block: int, offset: int, nbytes: int) -> memoryview | bytes:
        rows = self._rows[ref.tensor_idx]
        start = ref.offset_bytes + offset
        if isinstance(rows, np.ndarray):
            return memoryview(rows[block, start:start + nbytes])
        return rows[block, start:start + nbytes].cpu().numpy().tobytes()  # a device's: through host memory


def mismatch(ours: BlockDigests, local_ids: Sequence[Sequence[int]], remote_ids: Sequence[Sequence[int]],
             read: Sequence[set[tuple[str, int]]], blob: bytes,
             their_keys: Sequence[Sequence[tuple[str, int]]]) -> str | None:
    """Check what a read brought: at every position where both ids are blocks, every unit
    in `read[g]` of our block against the holder's digest of it (`blob`, the holder
    rank's, whose units are `their_keys[g]`). None when all match, else what did not."""
    try:
        tables = expected(blob, remote_ids, [len(keys) for keys in their_keys])
    except ValueError as exc:
        return str(exc)
    for group, (lids, rids, keys, table) in enumerate(zip(local_ids, remote_ids, read, tables)):
        ours_by_key = {key: i for i, key in enumerate(ours.unit_keys(group))}
        theirs_by_key = {key: i for i, key in enumerate(their_keys[group])}
        units = [(ours_by_key[key], theirs_by_key[key], key) for key in sorted(keys)]
        for position, (local, remote) in enumerate(zip(lids, rids)):
            if not local or not remote:
                continue
            for mine, theirs, key in units:
                if ours.digest(group, local, mine) != int(table[position, theirs]):
                    return f"group {group}, block {remote} (position {position}), {key[0]} {key[1]}"
    return None


def expected(blob: bytes, remote_ids: Sequence[Sequence[int]], units_per_group: Sequence[int]) -> list[np.ndarray]:
    """The holder's digests of one rank (`blob`) as, per group, an array (positions,
    units). ValueError when the blob does not hold as many as the block lists say."""
    sizes = [len(ids) * units for ids, units in zip(remote_ids, units_per_group)]
    if len(blob) != DIGEST_BYTES * sum(sizes):
        raise ValueError(f"the holder's digests are {len(blob)} bytes where its blocks need "
                         f"{DIGEST_BYTES * sum(sizes)}")
    words = np.frombuffer(blob, dtype="<u8")
    bounds = np.cumsum([0, *sizes])
    return [words[start:end].reshape(len(ids), units)
            for start, end, ids, units in zip(bounds[:-1], bounds[1:], remote_ids, units_per_group)]


def _host_rows(tensor: torch.Tensor) -> np.ndarray | torch.Tensor:
    """A tensor's rows as bytes: a numpy view of host memory, or the device tensor."""
    rows = tensor.view(torch.uint8)
    return rows.numpy() if rows.device.type == "cpu" else rows
