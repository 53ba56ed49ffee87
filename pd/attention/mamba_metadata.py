"""Metadata for Mamba2 layers: where each request reads and writes its state blocks.

Align mode: the Mamba block at index j of a request's block list holds the state after
`(j+1) * block_size` tokens once those are computed; the block holding the *running*
state after C tokens is index `(C-1) // block_size`. For a step that computes tokens
`[C, C+n)` of a request:

- it reads the state after C tokens from block `(C-1) // block_size` (zeros when C == 0);
- it writes the state after every block boundary `(j+1)*block_size` in `(C, C+n]` to
  block j, and the final state after C+n tokens to block `(C+n-1) // block_size`
  (the same write when C+n is a boundary).

A block it reads is never one it writes unless both hold the running state of a block
not yet full, so prefix-cached boundary states are never overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pd.attention.backend import CommonAttentionMetadata


@dataclass(frozen=True)
class MambaRequestSlice:
    """One request's new tokens `[query_start, query_start + query_len)` of the batch.

    `writes`: (n, block): the state after the first n new tokens goes to `block`;
    sorted by n, the last one has n == query_len.
    """

    query_start: int
    query_len: int
    num_computed_tokens: int
    read_block: int | None
    writes: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class MambaMetadata:
    """Requests computing more than one token go through `prefills` one by one; the
    single-token ones are batched through the `decode_*` tensors (on the model device)."""

    prefills: list[MambaRequestSlice]
    decode_token_indices: torch.Tensor  # int64 (num_decodes,): batch rows of decode tokens
    decode_read_blocks: torch.Tensor  # int64 (num_decodes,): 0 (null) where no state yet
    decode_has_state: torch.Tensor  # bool (num_decodes,)
    decode_write_blocks: torch.Tensor  # int64 (num_decodes,)

    @property
    def num_decodes(self) -> int:
        return int(self.decode_token_indices.numel())


def build_mamba_metadata(
    common: CommonAttentionMetadata,
    device: torch.device | str,
    block_table_cpu: torch.Tensor | None = None,
) -> MambaMetadata:
    """Where each request of the batch reads and writes its Mamba state (see the module
    docstring). `block_table_cpu`, when given, is a host copy of `common.block_table`
    (spares a device-to-host copy); the table is read once either way.

    Boundary writes to the null block 0 (a block the group does not keep) are dropped;
    a read or a final write that falls on block 0 is a caller error (ValueError).
    Requests with no new tokens are skipped.
    """
    table = (common.block_table if block_table_cpu is None else block_table_cpu).tolist()
    prefills: list[MambaRequestSlice] = []
    decodes: list[tuple[int, int | None, int]] = []  # (token row, read block, write block)
    for i in range(common.num_reqs):
        n = common.query_len(i)
        if n == 0:
            continue
        req = _request_slice(common.query_start_loc_cpu[i], n, common.num_computed_tokens_cpu[i],
                             table[i], common.block_size)
        if n == 1:
            decodes.append((req.query_start, req.read_block, req.writes[-1][1]))
        else:
            prefills.append(req)
    return MambaMetadata(
        prefills=prefills,
        decode_token_indices=_int64([row for row, _, _ in decodes], device),
        decode_read_blocks=_int64([read or 0 for _, read, _ in decodes], device),
        decode_has_state=torch.tensor([read is not None for _, read, _ in decodes], dtype=torch.bool,
                                      device=device),
        decode_write_blocks=_int64([write for _, _, write in decodes], device),
    )


def _request_slice(query_start: int, n: int, computed: int, row: list[int], block_size: int) -> MambaRequestSlice:
    """One request's read block and writes for new tokens `[computed, computed + n)`."""
    read = None
    if computed > 0:
        read = row[(computed - 1) // block_size]
        if read == 0:
            raise ValueError(f"request at batch row {query_start}: the state after {computed} tokens "
                             f"is in the null block")
    writes = [((j + 1) * block_size - computed, row[j])
              for j in range(computed // block_size, (computed + n) // block_size) if row[j] != 0]
    last = row[(computed + n - 1) // block_size]
    if last == 0:
        raise ValueError(f"request at batch row {query_start}: its final state would go to the null block")
    if not writes or writes[-1][0] != n:
        writes.append((n, last))
    return MambaRequestSlice(query_start=query_start, query_len=n, num_computed_tokens=computed,
                             read_block=read, writes=tuple(writes))


def _int64(values: list[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
