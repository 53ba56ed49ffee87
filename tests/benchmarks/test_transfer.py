"""benchmarks/transfer.py's block sweep runs end to end on real NIXL and CMA and checks
the bytes each path landed (its figures are not asserted: benchmarks measure, tests don't)."""

from __future__ import annotations

import json

import pytest

from benchmarks import transfer


def test_the_sweep_lands_the_right_bytes_and_writes_its_table(tmp_path, capsys) -> None:
    out = tmp_path / "transfer.json"
    result = transfer.main(["--block-kib", "64", "--read-mib", "1", "--repeats", "2", "--output", str(out)])
    (row,) = result["sweep"]
    assert row["block_bytes"] == 64 << 10 and row["blocks"] == 16 and row["bytes"] == 1 << 20
    assert all(row[f"{k}_gbps"] > 0 for k in ("nixl", "cma", "memcpy", "nixl_notif", "nixl_checked"))
    assert isinstance(row["check_share"], float)  # the digest check's share of the READ (checked: it raised not)
    assert json.loads(out.read_text())["sweep"] == [row]
    table = capsys.readouterr().out
    assert "| 64 KiB | 16 | 1 |" in table and "NIXL / CMA" in table and "check / READ" in table


def test_the_digest_check_raises_on_other_bytes() -> None:
    """The sweep's check is the worker's: bytes other than the holder's fail it."""
    import torch

    holders = torch.randint(-128, 128, (8, 256), dtype=torch.int8)
    ours = holders.clone()
    check = transfer.digest_check(transfer.block_caches(ours), transfer.block_caches(holders), [[1, 2]], [[1, 2]])
    check()
    ours[2, 7] += 1
    with pytest.raises(AssertionError, match="other bytes: group 0, block 2"):
        check()


def test_cma_read_copies_ranges_of_another_process(tmp_path) -> None:
    """process_vm_readv on ourselves: the baseline's copy is a real copy of the ranges."""
    import os

    import torch

    src = torch.arange(4096, dtype=torch.int32).view(torch.int8).reshape(16, 1024)
    dst = torch.zeros_like(src)
    ranges = [(3, 5), (9, 0)]
    copied = transfer.cma_read(os.getpid(), [(dst.data_ptr() + d * 1024, 1024) for _, d in ranges],
                               [(src.data_ptr() + s * 1024, 1024) for s, _ in ranges])
    assert copied == 2048 and torch.equal(dst[5], src[3]) and torch.equal(dst[0], src[9])


def test_the_tensor_parallel_sweep_reads_each_heads_bytes_once(tmp_path, capsys) -> None:
    """(P TP, D TP) pairs: decode rank 0 gets exactly its heads (checked inside), with one
    descriptor per block per prefill rank it reads from."""
    result = transfer.main(["--skip-block-sweep", "--tp-pairs", "1x2", "2x1", "2x2", "--block-kib", "64",
                            "--read-mib", "1", "--repeats", "2", "--output", str(tmp_path / "t.json")])
    rows = {(r["p_tp"], r["d_tp"]): r for r in result["tp_pairs"]}
    assert set(rows) == {(1, 2), (2, 1), (2, 2)} and result["sweep"] == []
    assert [rows[pair]["p_ranks_read"] for pair in sorted(rows)] == [1, 2, 1]
    assert rows[(1, 2)]["descriptors"] == rows[(1, 2)]["blocks"]  # half of each block from the one P rank
    assert rows[(2, 1)]["descriptors"] == 2 * rows[(2, 1)]["blocks"]  # a half from each P rank
    assert rows[(2, 2)]["descriptors"] == rows[(2, 2)]["blocks"]  # whole rows, scattered: one per block
    assert all(r["bytes"] == r["blocks"] * (64 << 10) // r["d_tp"] == 1 << 20 for r in rows.values())
    assert "| 2 | 1 | 64 KiB |" in capsys.readouterr().out
