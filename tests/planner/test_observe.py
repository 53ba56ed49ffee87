"""What the planner reads of a server's /metrics (planner/observe.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from planner.model import Costs
from planner.observe import SHIFT_TICKS, Counters, Observer, server_counters

METRICS = """# HELP pd_prompt_tokens_by_source_total x
# TYPE pd_prompt_tokens_by_source_total counter
pd_prompt_tokens_by_source_total{source="computed"} 900.0
pd_prompt_tokens_by_source_total{source="local_cache"} 100.0
# TYPE pd_engine_step_seconds_total counter
pd_engine_step_seconds_total{part="schedule"} 0.5
pd_engine_step_seconds_total{part="execute"} 2.0
# TYPE pd_engine_steps_total counter
pd_engine_steps_total 40.0
# TYPE pd_generation_tokens_total counter
pd_generation_tokens_total 120.0
# TYPE pd_request_success_total counter
pd_request_success_total{finish_reason="length"} 3.0
pd_request_success_total{finish_reason="stop"} 1.0
# TYPE pd_num_requests_running gauge
pd_num_requests_running 2.0
"""


def test_a_servers_figures_are_summed_over_their_series_and_differenced_between_ticks() -> None:
    c = server_counters(METRICS, 10.0)
    assert (c.computed, c.busy_s, c.steps, c.generated, c.finished, c.running) == (900, 2.5, 40, 120, 4, 2)
    later = server_counters(METRICS.replace("pd_engine_steps_total 40.0", "pd_engine_steps_total 50.0"), 12.0)
    delta = later.minus(c)
    assert (delta.at, delta.steps, delta.computed, delta.running) == (2.0, 10, 0, 2)


@dataclass
class ScriptedObserver(Observer):
    """The observer with the proxy's fleet and each server's counters given by the test."""

    fleet: dict = field(default_factory=dict)
    counters: dict[str, Counters] = field(default_factory=dict)
    now: float = 0.0

    def _admin(self, path: str) -> dict:
        return self.fleet

    def _metrics(self, url: str) -> str:
        c = self.counters[url]
        return "\n".join([f'pd_prompt_tokens_by_source_total{{source="computed"}} {c.computed}',
                          f"pd_engine_steps_total {c.steps}", f"pd_engine_step_seconds_total {c.busy_s}",
                          f"pd_generation_tokens_total {c.generated}", f"pd_request_success_total {c.finished}",
                          f"pd_num_requests_running {c.running}"]) + "\n"


def instance(url: str, role: str) -> dict:
    return {"url": url, "role": role, "roles": ["prefill", "decode"], "outstanding": 0, "bound": 0,
            "draining": False, "leaving": False, "outstanding_tokens": 0}


def test_a_prompt_longer_than_a_tick_counts_whole_however_its_chunks_fall_among_ticks_and_servers() -> None:
    """Two prefill servers computing 2048-token prompts in 1024-token chunks, a chunk per
    server per tick, each server finishing a prompt every other tick (their halves out of
    step): every tick one prompt of 2048 tokens ends. A server's own tick says 1024 (or
    nothing); the fleet's ticks say 2048. (The planner took such a prompt for 1024 tokens
    and a swamped prefill pool for one with room: its queue unseen.)"""
    observer = ScriptedObserver("p", "k", Costs(1000.0, 0.01, 0.001), clock=lambda: observer.now,
                                fleet={"instances": [instance("a", "prefill"), instance("b", "prefill")],
                                       "arrivals": 0})
    a, b = Counters(0.0), Counters(0.0)
    observer.counters = {"a": a, "b": b}
    for tick in range(12):
        for server, ends in ((a, tick % 2 == 0), (b, tick % 2 == 1)):
            server.computed += 1024
            server.busy_s += 1.0
            server.finished += 1 if ends else 0
        observer.now = float(tick)
        _, load, costs = observer.observe()
    assert load.prompt_tokens == pytest.approx(2048)
    assert costs.prefill_tokens_per_s == pytest.approx(1024)


def test_an_idle_tick_keeps_what_was_learned() -> None:
    observer = ScriptedObserver("p", "k", Costs(1000.0, 0.01, 0.001), clock=lambda: observer.now,
                                fleet={"instances": [instance("a", "prefill")], "arrivals": 0})
    server = Counters(0.0)
    observer.counters = {"a": server}
    for tick in range(6):
        if tick < 3:
            server.computed += 500
            server.finished += 1
            server.busy_s += 0.5
        observer.now = float(tick)
        _, load, _ = observer.observe()
    assert load.prompt_tokens == pytest.approx(500)


@pytest.mark.parametrize("window", [0.0, 20.0])
def test_a_load_window_plans_for_the_mean_of_a_swinging_load_not_its_last_swing(window: float) -> None:
    """Arrivals swinging between 39 and 21 a second every 10 s (30 +- 30 %): with a 20 s
    window the planner's rate is the mean, 30, whichever half it is in; without, it follows
    the swing."""
    fleet = {"instances": [], "arrivals": 0}
    observer = ScriptedObserver("p", "k", Costs(1000.0, 0.01, 0.001), clock=lambda: observer.now,
                                load_window_s=window, fleet=fleet)
    rates = []
    for tick in range(60):
        fleet["arrivals"] += 39 if (tick // 10) % 2 == 0 else 21
        observer.now = float(tick)
        rates.append(observer.observe()[1].arrival_rate)
    if window:
        assert all(r == pytest.approx(30, abs=1) for r in rates[25:])
    else:
        assert rates[29] == pytest.approx(39, abs=0.1) and rates[39] == pytest.approx(21, abs=0.1)


@pytest.mark.parametrize("after", [18.0, 2.0])
def test_a_load_window_restarts_where_the_rate_doubled_or_halved(after: float) -> None:
    """A phase change, 6 a second to 18 or 2, is followed within SHIFT_TICKS ticks, not a
    whole window later."""
    fleet = {"instances": [], "arrivals": 0}
    observer = ScriptedObserver("p", "k", Costs(1000.0, 0.01, 0.001), clock=lambda: observer.now,
                                load_window_s=30.0, fleet=fleet)
    for tick in range(40 + SHIFT_TICKS + 1):
        fleet["arrivals"] += 6 if tick < 40 else after
        observer.now = float(tick)
        rate = observer.observe()[1].arrival_rate
    assert rate == pytest.approx(after)
