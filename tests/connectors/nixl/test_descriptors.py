"""The runs a READ's descriptors are built from."""

from __future__ import annotations

from connectors.nixl.descriptors import paired_runs


def test_paired_runs_matches_a_brute_force_split() -> None:
    import random

    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(0, 12)
        local = [rng.choice([0, rng.randint(1, 20)]) for _ in range(n)]
        remote = [rng.choice([0, rng.randint(1, 20)]) for _ in range(n)]
        runs = paired_runs(local, remote)
        expanded = [(lb + i, rb + i) for lb, rb, k in runs for i in range(k)]
        assert expanded == [(lb, rb) for lb, rb in zip(local, remote) if lb and rb]
        for (l0, r0, k0), (l1, r1, _) in zip(runs, runs[1:]):  # maximal: no two runs could merge
            assert (l0 + k0, r0 + k0) != (l1, r1)


def _layout(row: int, pieces: list, base: int, engine_id: str):
    from connectors.nixl.peer_messages import DataRefInfo, KVLayoutInfo, PieceInfo, TensorInfo

    return KVLayoutInfo(engine_id, [TensorInfo(base, 64, row)], [[DataRefInfo(0, row)]], [16], "h",
                        group_pieces=[[PieceInfo("head", h, i * 100, 100) for i, h in enumerate(pieces)]])


def test_a_read_between_other_heads_is_one_descriptor_per_block_per_run() -> None:
    """D holds heads 2, 3 (of 4); P holds all four: one run per block, at P's offset of
    head 2 and D's 0; null positions skipped; a second peer gives nothing already taken."""
    import numpy as np

    from connectors.nixl.descriptors import piece_runs, read_descriptors

    ours, theirs = _layout(200, [2, 3], 0x1000, "D"), _layout(400, [0, 1, 2, 3], 0x90000, "P")
    taken = [set()]
    runs = piece_runs(ours.group_pieces, theirs.group_pieces, taken)
    assert runs == [[(200, 0, 200)]] and taken == [{("head", 2), ("head", 3)}]
    local, remote = read_descriptors(ours.tensors, ours.group_data_refs, theirs, [[5, 6, 0, 9]], [[7, 8, 3, 0]], runs)
    assert local[:, 0].tolist() == [0x1000 + 5 * 200, 0x1000 + 6 * 200]  # blocks 5, 6: adjacent, not merged
    assert remote[:, 0].tolist() == [0x90000 + 7 * 400 + 200, 0x90000 + 8 * 400 + 200]
    assert local[:, 1].tolist() == remote[:, 1].tolist() == [200, 200]
    assert piece_runs(ours.group_pieces, theirs.group_pieces, taken) == [[]]  # another P rank: nothing left
    same = [set()]
    assert piece_runs(ours.group_pieces, ours.group_pieces, same) is None and same == taken  # whole rows
    assert np.array_equal(read_descriptors(ours.tensors, ours.group_data_refs, ours, [[5, 6]], [[7, 8]])[1][:, 1],
                          np.array([(2 - 1) * 200 + 200], dtype=np.uint64))  # equal layouts: runs of blocks merge
