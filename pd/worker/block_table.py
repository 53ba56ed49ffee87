"""Block tables: per KV cache group, one row of positional block ids per request.

Entry j of a request's row holds positions `[j*block_size, (j+1)*block_size)`. Rows
live in a fixed host array so a step only appends new ids; `batch` gathers the rows of
the step's requests, in batch order, into one device tensor.
"""

from __future__ import annotations

import numpy as np
import torch


class BlockTable:
    def __init__(self, block_size: int, max_num_reqs: int, max_blocks_per_req: int,
                 device: torch.device | str) -> None:
        self.block_size = block_size
        self.max_blocks_per_req = max_blocks_per_req
        self.device = device
        self.table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)

    def set_row(self, row: int, block_ids: list[int]) -> None:
        self.num_blocks[row] = 0
        self.append(row, block_ids)

    def append(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_blocks_per_req:
            raise ValueError(f"request row {row} would hold {end} blocks, past {self.max_blocks_per_req}")
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def batch(self, rows: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
        """The rows of a step (host array, device tensor), trimmed to the longest row."""
        width = max(1, int(self.num_blocks[rows].max())) if len(rows) else 1
        host = self.table[rows, :width]
        return host, torch.from_numpy(host).to(self.device, non_blocking=True)

    def slot_mapping(self, token_rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Cache slot (block * block_size + offset) of each new token."""
        blocks = self.table[token_rows, positions // self.block_size].astype(np.int64)
        return blocks * self.block_size + positions % self.block_size


class MultiGroupBlockTable:
    """One BlockTable per KV cache group; block ids cross in and out as
    `list[list[int]]`, groups outer."""

    def __init__(self, block_sizes: list[int], max_num_reqs: int, max_model_len: int,
                 device: torch.device | str) -> None:
        self.tables = [BlockTable(bs, max_num_reqs, -(-max_model_len // bs), device) for bs in block_sizes]

    def __getitem__(self, group_id: int) -> BlockTable:
        return self.tables[group_id]

    def __len__(self) -> int:
        return len(self.tables)

    def set_row(self, row: int, block_ids: list[list[int]]) -> None:
        for table, ids in zip(self.tables, block_ids, strict=True):
            table.set_row(row, ids)

    def append(self, row: int, block_ids: list[list[int]]) -> None:
        for table, ids in zip(self.tables, block_ids, strict=True):
            table.append(row, ids)
