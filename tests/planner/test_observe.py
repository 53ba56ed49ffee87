"""What the planner reads of a server's /metrics (planner/observe.py)."""

from __future__ import annotations

from planner.observe import server_counters

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
