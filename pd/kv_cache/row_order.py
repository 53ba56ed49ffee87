"""The byte order of one KV cache group's data in a block: heads outermost, then layers.

A group's data for block b is one region of the block's row (the canonical buffer: all
`L` layers of the group in one region; the per-layer layout: one region per layer, so
`L = 1`). Within the region:

- attention (full or sliding window): `[kv head][layer][K/V][token][head dim]`; head h
  is the range `[h * L * P, (h + 1) * L * P)`, `P` = `spec.head_page_bytes`;
- Mamba2: `[Mamba group g][ shared: [layer][B/C][state][conv width] | heads of g:
  [head][layer][ SSM (head dim, state) | x conv (head dim, conv width) ] ]`.

So any contiguous run of heads (for Mamba: of whole Mamba groups) of a block is one byte
range for every layer of the group at once: a tensor-parallel rank's share of a block,
for any TP size that divides the heads, is one range, and a transfer between ranks
needs at most one descriptor per block per pair of ranks, never one per layer. A
Mamba split inside one group (more ranks than Mamba groups, B and C replicated)
costs one more range: the group's shared part.

`pieces` names each part of the region: `("head", h)` and, for Mamba, `("shared", g)`,
with its offset and size; two ranks that hold the same piece hold the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd.kv_cache.spec import FullAttentionSpec, KVCacheSpec, MambaSpec

PieceKey = tuple[str, int]  # ("head", head index) or ("shared", Mamba group index)


@dataclass(frozen=True)
class Piece:
    """Bytes `[offset, offset + nbytes)` of a group's region in a block hold `key`."""

    key: PieceKey
    offset: int
    nbytes: int


def pieces(spec: KVCacheSpec, num_layers: int, first_head: int = 0, first_group: int = 0) -> tuple[Piece, ...]:
    """The parts of a region holding `num_layers` layers of `spec`, in byte order.

    Head and group indices start at `first_head` / `first_group`: the global index of a
    tensor-parallel rank's first head (its own heads are numbered from 0 in the spec).
    """
    head = head_stride(spec, num_layers)
    if isinstance(spec, FullAttentionSpec):
        return tuple(Piece(("head", first_head + h), h * head, head) for h in range(spec.num_kv_heads))
    if isinstance(spec, MambaSpec):
        shared, per_group = num_layers * spec.group_shared_bytes, spec.num_heads // spec.n_groups
        out: list[Piece] = []
        for g in range(spec.n_groups):
            start = g * mamba_group_stride(spec, num_layers)
            out.append(Piece(("shared", first_group + g), start, shared))
            out.extend(Piece(("head", first_head + g * per_group + j), start + shared + j * head, head)
                       for j in range(per_group))
        return tuple(out)
    raise TypeError(f"no row order for spec {type(spec).__name__}")


def mamba_group_stride(spec: MambaSpec, num_layers: int) -> int:
    """Bytes between Mamba group g and g + 1 in a region of `num_layers` layers."""
    return num_layers * (spec.group_shared_bytes + spec.num_heads // spec.n_groups * spec.head_page_bytes)


def head_stride(spec: KVCacheSpec, num_layers: int) -> int:
    """Bytes between head h and h + 1 (within one Mamba group for Mamba)."""
    return num_layers * spec.head_page_bytes


def transfer_runs(source: tuple[Piece, ...], destination: tuple[Piece, ...],
                  taken: set[PieceKey]) -> list[tuple[int, int, int]]:
    """`(source offset, destination offset, nbytes)` runs that fill every piece of
    `destination` that `source` holds and that is not in `taken` (a piece another source
    fills already; the keys filled here are added). Pieces adjacent on both sides merge
    into one run: between workers whose heads are a contiguous run of each other's, that
    is one run per region."""
    held = {p.key: p for p in source}
    runs: list[tuple[int, int, int]] = []
    for piece in destination:
        mine = held.get(piece.key)
        if mine is None or piece.key in taken:
            continue
        if mine.nbytes != piece.nbytes:
            raise ValueError(f"{piece.key} is {mine.nbytes} bytes at the source, {piece.nbytes} here")
        taken.add(piece.key)
        if runs and runs[-1][0] + runs[-1][2] == mine.offset and runs[-1][1] + runs[-1][2] == piece.offset:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + piece.nbytes)
        else:
            runs.append((mine.offset, piece.offset, piece.nbytes))
    return runs
