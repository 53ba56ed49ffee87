"""BlockTable: rows of positional block ids, batch gathering and slot mapping."""

from __future__ import annotations

import numpy as np
import pytest

from pd.worker.block_table import BlockTable, MultiGroupBlockTable


def test_rows_append_and_batch_in_the_order_asked() -> None:
    table = BlockTable(block_size=4, max_num_reqs=3, max_blocks_per_req=5, device="cpu")
    table.set_row(0, [7, 8])
    table.set_row(2, [3])
    table.append(2, [9, 1])
    host, device = table.batch(np.array([2, 0]))
    assert host.tolist() == [[3, 9, 1], [7, 8, 0]]
    assert device.tolist() == host.tolist()
    table.set_row(2, [5])  # a resumed request starts its row afresh
    assert table.batch(np.array([2]))[0].tolist() == [[5]]


def test_slot_mapping_is_block_times_size_plus_offset() -> None:
    table = BlockTable(block_size=4, max_num_reqs=2, max_blocks_per_req=4, device="cpu")
    table.set_row(0, [7, 8, 2])
    table.set_row(1, [5])
    slots = table.slot_mapping(np.array([0, 0, 0, 1]), np.array([3, 4, 9, 2]))
    assert slots.tolist() == [7 * 4 + 3, 8 * 4 + 0, 2 * 4 + 1, 5 * 4 + 2]


def test_a_row_cannot_outgrow_the_longest_request() -> None:
    table = BlockTable(block_size=4, max_num_reqs=1, max_blocks_per_req=2, device="cpu")
    table.set_row(0, [1, 2])
    with pytest.raises(ValueError, match="past 2"):
        table.append(0, [3])


def test_multi_group_tables_size_rows_by_their_block_size() -> None:
    tables = MultiGroupBlockTable([4, 16], max_num_reqs=2, max_model_len=33, device="cpu")
    assert [t.max_blocks_per_req for t in tables.tables] == [9, 3]
    tables.set_row(1, [[1, 2], [3]])
    tables.append(1, [[4], []])
    assert tables[0].batch(np.array([1]))[0].tolist() == [[1, 2, 4]]
    assert tables[1].batch(np.array([1]))[0].tolist() == [[3]]
    with pytest.raises(ValueError):
        tables.set_row(0, [[1]])  # one list per group
