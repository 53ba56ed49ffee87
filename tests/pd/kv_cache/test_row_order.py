"""The row order's claim, end to end on real allocations: a worker holding some heads
(a tensor-parallel rank) fills its blocks from workers holding others by copying the
byte runs `transfer_runs` plans, one run per block per pair of workers (two where a
Mamba group is split and B and C sit apart), and then its views read exactly the
heads a one-worker cache holds for it."""

from __future__ import annotations

import pytest
import torch

from pd.kv_cache.row_order import Piece, pieces, transfer_runs
from tests.support.tp_caches import FULL, LAYERS, MAMBA, SLIDING, copy_pieces, expected_views, fill, rank_cache, views

BLOCKS = ([1, 2], [3], [4])  # per group: a block is one group's at a time, its row that group's region


def _copy(source, destination, taken: list[set]) -> list[int]:
    return copy_pieces(source, destination, taken, BLOCKS)


PAIRS = [(1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 4), (4, 2)]


@pytest.mark.parametrize("layout", ["canonical", "per-layer"])
@pytest.mark.parametrize("p_tp, d_tp", PAIRS)
def test_decode_ranks_read_exactly_their_heads_from_prefill_ranks(p_tp: int, d_tp: int, layout: str) -> None:
    whole, _ = rank_cache(1, 0, layout)
    fill(whole, seed=0)
    prefill = []
    for rank in range(p_tp):  # prefill rank r holds its share of the one-worker cache's bytes
        source = rank_cache(p_tp, rank, layout)
        _copy((whole, whole.describe()), source, [set(), set(), set()])
        prefill.append(source)
    for rank in range(d_tp):
        decode = rank_cache(d_tp, rank, layout)
        fill(decode[0], seed=100 + rank)  # stale bytes everywhere: the read must replace them
        taken: list[set] = [set(), set(), set()]
        runs = [_copy(source, decode, taken) for source in prefill]
        for blocks, names in zip(BLOCKS, LAYERS.values()):
            for layer in names:
                for got, want in zip(views(decode[0].layer_caches[layer]), expected_views(whole, d_tp, rank, layer)):
                    assert torch.equal(got[blocks], want[blocks]), (layer, rank)
        # every piece came from one prefill rank, and at most the runs the design says
        assert all(len(t) == len(p) for t, p in zip(taken, decode[1].group_pieces))
        for g in range(3):
            assert sum(r[g] for r in runs) <= max(1, p_tp // d_tp) + (g == 2), (g, runs)


def test_attention_runs_per_pair_never_exceed_one() -> None:
    """Same heads or a contiguous share of them: one run per region, any TP pair."""
    for p_tp, d_tp in PAIRS:
        for d_rank in range(d_tp):
            _, dst = rank_cache(d_tp, d_rank, "canonical")
            for p_rank in range(p_tp):
                _, src = rank_cache(p_tp, p_rank, "canonical")
                for g in (0, 1):
                    assert len(transfer_runs(src.group_pieces[g], dst.group_pieces[g], set())) <= 1


def test_a_mamba_group_split_in_two_costs_one_more_run_for_its_second_half() -> None:
    """[B, C | heads] per group: the first half of a group's heads is one run with B and
    C, the second half two (TP 4 over 2 Mamba groups)."""
    _, whole = rank_cache(1, 0, "canonical")
    counts = [len(transfer_runs(whole.group_pieces[2], rank_cache(4, r, "canonical")[1].group_pieces[2], set()))
              for r in range(4)]
    assert counts == [1, 2, 1, 2]


def test_transfer_runs_refuses_pieces_of_different_sizes() -> None:
    a = (Piece(("head", 0), 0, 8),)
    b = (Piece(("head", 0), 0, 16),)
    with pytest.raises(ValueError, match="bytes"):
        transfer_runs(a, b, set())


def test_pieces_of_a_region_cover_it_in_byte_order() -> None:
    for spec in (FULL, SLIDING, MAMBA):
        for layers in (1, 3):
            parts = pieces(spec, layers)
            assert [p.offset for p in parts] == sorted(p.offset for p in parts)
            assert all(a.offset + a.nbytes == b.offset for a, b in zip(parts, parts[1:]))
            assert parts[-1].offset + parts[-1].nbytes == layers * spec.real_page_size_bytes
