"""The planner's decisions (planner/policy.py): toward the best split, one server at a
time, after `patience` ticks and a cool-down, never flapping on a split meeting the SLO."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from planner.model import Costs, Load
from planner.policy import Member, Planner, Scaling, Slo

COSTS = Costs(prefill_tokens_per_s=1000.0, decode_step_s=0.02, decode_step_per_seq_s=0.002)
SLO = Slo(ttft_s=2.0, tpot_s=0.06, percentile=0.9)
PREFILL_HEAVY = Load(3.0, 500, 20)  # 1 500 prompt tokens/s: more than one prefill server computes
DECODE_HEAVY = Load(2.0, 50, 300)  # 600 sequences' tokens/s: step time doubles on one decode server


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def fleet(roles: str, switchable: str = "yyyy", in_flight=(0, 0, 0, 0)) -> list[Member]:
    return [Member(f"http://127.0.0.1:{8000 + i}", "prefill" if r == "p" else "decode",
                   ("prefill", "decode") if s == "y" else ("prefill" if r == "p" else "decode",), n)
            for i, (r, s, n) in enumerate(zip(roles, switchable, in_flight))]


def test_a_prefill_heavy_load_moves_the_least_loaded_decode_server_after_patience() -> None:
    clock = Clock()
    planner = Planner(SLO, patience=2, cooldown_s=10, clock=clock)
    members = fleet("pdd", in_flight=(0, 3, 1))
    first = planner.decide(members, PREFILL_HEAVY, COSTS)
    assert first.action == "hold" and "1 of 2" in first.reason and "1P2D" in first.reason
    second = planner.decide(members, PREFILL_HEAVY, COSTS)
    assert (second.action, second.url, second.role) == ("switch", members[2].url, "prefill")
    assert second.inputs["now"] == "1P2D" and second.inputs["splits"]["1P2D"]["ttft_s"] == "inf"
    assert second.inputs["splits"]["2P1D"]["ttft_s"] < 3.0  # rho 0.75: p90 waits ln(7.5) / (0.25 x 4) s


def test_a_move_waits_for_the_cool_down_and_never_takes_a_role_empty() -> None:
    clock = Clock()
    planner = Planner(SLO, patience=1, cooldown_s=10, clock=clock)
    assert planner.decide(fleet("pddd"), PREFILL_HEAVY, COSTS).action == "switch"
    clock.t = 5
    held = planner.decide(fleet("ppdd"), Load(6.0, 500, 20), COSTS)  # wants a third prefill server
    assert held.action == "hold" and "cooling down" in held.reason
    clock.t = 11
    moved = planner.decide(fleet("ppdd"), Load(6.0, 500, 20), COSTS)
    assert moved.action == "switch" and moved.role == "prefill"
    assert planner.decide(fleet("pppd"), Load(60.0, 500, 20), COSTS).action == "keep"  # one D is left, always


def test_a_decode_heavy_load_moves_a_prefill_server_to_decode() -> None:
    planner = Planner(SLO, patience=1, cooldown_s=0)
    decision = planner.decide(fleet("ppd"), DECODE_HEAVY, COSTS)
    assert (decision.action, decision.role) == ("switch", "decode")


def test_a_split_meeting_the_slo_is_kept_unless_another_is_much_better() -> None:
    planner = Planner(SLO, patience=1, cooldown_s=0, margin=0.2)
    light = Load(0.2, 200, 20)
    for roles in ("pdd", "ppd"):
        assert planner.decide(fleet(roles), light, COSTS).action == "keep"


def test_alternating_wishes_never_reach_patience() -> None:
    planner = Planner(SLO, patience=2, cooldown_s=0)
    for _ in range(5):
        assert planner.decide(fleet("pdd"), PREFILL_HEAVY, COSTS).action == "hold"
        assert planner.decide(fleet("ppd"), DECODE_HEAVY, COSTS).action == "hold"


def test_servers_with_one_role_are_never_moved() -> None:
    planner = Planner(SLO, patience=1, cooldown_s=0)
    fixed = fleet("pdd", switchable="nnn")
    assert planner.decide(fixed, PREFILL_HEAVY, COSTS).action == "keep"
    mixed = fleet("pdd", switchable="nny")
    decision = planner.decide(mixed, PREFILL_HEAVY, COSTS)
    assert (decision.action, decision.url) == ("switch", mixed[2].url)


def test_draining_servers_are_neither_counted_nor_moved() -> None:
    planner = Planner(SLO, patience=1, cooldown_s=0)
    members = fleet("pdd")
    members[2] = Member(members[2].url, "decode", ("prefill", "decode"), 0, draining=True)
    assert planner.decide(members, PREFILL_HEAVY, COSTS).action == "keep"  # 1P1D is all that takes requests


PREFILL_BOUND = Load(1.5, 500, 20)  # 750 prompt tokens/s: one prefill server at 0.75, its p90 wait past the SLO
LIGHT = Load(0.2, 100, 20)


def test_without_scaling_the_fleet_never_grows_or_shrinks() -> None:
    planner = Planner(SLO, patience=1, cooldown_s=0)
    assert planner.decide(fleet("pd"), PREFILL_BOUND, COSTS).action == "keep"  # 1P1D misses; nothing to switch
    stoppable = [replace(m, stoppable=True) for m in fleet("ppdd")]
    assert planner.decide(stoppable, LIGHT, COSTS).action == "keep"


def test_a_fleet_missing_the_slo_with_nothing_to_switch_adds_a_server_of_the_role_it_lacks() -> None:
    planner = Planner(SLO, patience=2, cooldown_s=0, scaling=Scaling(2, 3))
    assert planner.decide(fleet("pd"), PREFILL_BOUND, COSTS).action == "hold"
    added = planner.decide(fleet("pd"), PREFILL_BOUND, COSTS)
    assert (added.action, added.url, added.role) == ("add", None, "prefill")
    assert added.inputs["now"] == "1P1D" and added.inputs["splits"]["2P1D"]["ttft_s"] < SLO.ttft_s
    # at the bound it adds nothing more, however far the load goes
    assert Planner(SLO, patience=1, cooldown_s=0, scaling=Scaling(2, 3)).decide(
        fleet("ppd"), Load(30.0, 500, 20), COSTS).action == "keep"


def test_a_switch_that_meets_the_slo_is_taken_before_a_server_is_added() -> None:
    planner = Planner(SLO, patience=1, cooldown_s=0, scaling=Scaling(2, 8))
    decision = planner.decide(fleet("pdd"), PREFILL_BOUND, COSTS)
    assert (decision.action, decision.role) == ("switch", "prefill")


def test_a_fleet_with_room_to_spare_stops_a_server_it_started_never_one_it_did_not_nor_below_the_minimum() -> None:
    members = fleet("ppdd", in_flight=(2, 0, 0, 0))
    started = [replace(m, stoppable=True) for m in members[:3]] + members[3:]
    removed = Planner(SLO, patience=1, cooldown_s=0, scaling=Scaling(2, 4), scale_down_after_s=0).decide(
        started, LIGHT, COSTS)
    assert (removed.action, removed.url, removed.role) == ("remove", members[1].url, "prefill")
    only_decode = [replace(members[0]), replace(members[1]), replace(members[2], stoppable=True), members[3]]
    removed = Planner(SLO, patience=1, cooldown_s=0, scaling=Scaling(2, 4), scale_down_after_s=0).decide(
        only_decode, LIGHT, COSTS)
    assert (removed.action, removed.url) == ("remove", members[2].url)
    assert Planner(SLO, patience=1, cooldown_s=0, scaling=Scaling(2, 4)).decide(members, LIGHT, COSTS).action == "keep"
    assert Planner(SLO, patience=1, cooldown_s=0, scaling=Scaling(4, 6)).decide(started, LIGHT, COSTS).action == "keep"


def test_no_server_is_stopped_while_one_the_planner_started_is_still_starting() -> None:
    # 2P1D joined and a prefill server still starting: one fewer would meet the SLO, but the
    # fleet's size is in flux until the new one joins (stopping one for it undoes the start)
    joined = [replace(m, stoppable=True) for m in fleet("ppd")]
    starting = Member("http://127.0.0.1:8009", "prefill", ("prefill",), starting=True)
    planner = Planner(SLO, patience=1, cooldown_s=0, scaling=Scaling(2, 4), scale_down_after_s=0)
    assert planner.decide([*joined, starting], LIGHT, COSTS).action == "keep"
    joined_now = replace(starting, roles=("prefill", "decode"), stoppable=True, starting=False)
    assert planner.decide([*joined, joined_now], LIGHT, COSTS).action == "remove"


def test_a_server_is_stopped_only_once_fewer_have_been_enough_for_a_while_without_a_break() -> None:
    clock = Clock()
    planner = Planner(SLO, patience=1, cooldown_s=0, clock=clock, scaling=Scaling(2, 4), scale_down_after_s=30)
    started = [replace(m, stoppable=True) for m in fleet("ppdd")]
    held = planner.decide(started, LIGHT, COSTS)
    assert held.action == "hold" and "enough for 30 s" in held.reason
    clock.t = 20
    assert planner.decide(started, LIGHT, COSTS).action == "hold"
    clock.t = 25  # a burst between: 2P2D is what it needs, and the wish to stop one starts over
    assert planner.decide(started, Load(1.5, 500, 300), COSTS).action == "keep"
    clock.t = 26
    assert planner.decide(started, LIGHT, COSTS).action == "hold"
    clock.t = 50
    assert planner.decide(started, LIGHT, COSTS).action == "hold"  # 24 s since it began again
    clock.t = 56.5
    assert planner.decide(started, LIGHT, COSTS).action == "remove"


def test_a_fleet_that_just_meets_the_slo_keeps_its_servers() -> None:
    # 2P1D meets PREFILL_BOUND at 0.51 of the SLO; 1P1D (one fewer) misses it: no removal, no flapping back
    started = [replace(m, stoppable=True) for m in fleet("ppd")]
    planner = Planner(SLO, patience=1, cooldown_s=0, scaling=Scaling(2, 3))
    assert planner.decide(started, PREFILL_BOUND, COSTS).action == "keep"


def test_the_scaling_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="min instances"):
        Scaling(1, 3)
    with pytest.raises(ValueError, match="min instances"):
        Scaling(4, 3)


def test_a_large_fleet_moves_half_the_way_to_the_best_split_at_once_a_small_one_a_server_at_a_time() -> None:
    heavy = Load(12.0, 500, 20)  # 6 000 prompt tokens/s: beyond 6 prefill servers' 1 000 each
    members = fleet("p" + "d" * 15, "y" * 16, (0,) * 16)
    decision = Planner(SLO, patience=1, cooldown_s=0).decide(members, heavy, COSTS)
    target = int(re.findall(r"(\d+)P\d+D scores", decision.reason)[1])
    assert decision.action == "switch" and decision.role == "prefill" and target >= 8
    assert len(decision.urls) == 4  # half of a gap of 7 or more, capped at a quarter of the 16 servers
    assert len(set(decision.urls)) == 4 and members[0].url not in decision.urls
    capped = Planner(SLO, patience=1, cooldown_s=0, max_move=2).decide(members, heavy, COSTS)
    assert len(capped.urls) == 2
    assert len(Planner(SLO, patience=1, cooldown_s=0).decide(fleet("pdd"), PREFILL_HEAVY, COSTS).urls) == 1
