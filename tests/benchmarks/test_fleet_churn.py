"""The fleet changing under load (benchmarks/fleet_churn.py) on the tiny qwen3: switches,
drains, servers leaving (SIGTERM) and joining (--register) while requests run through
the proxy; not one fails or differs from colocated, and the KV is back to 0 after."""

from __future__ import annotations

import os

import pytest

from benchmarks.fleet_churn import parse_args, run

pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def test_nothing_is_lost_while_instances_join_drain_leave_and_switch_roles(tiny_models, tmp_path) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    args = parse_args(["--model", str(tiny_models["qwen3"]), "--requests", "96", "--concurrency", "8", "--interval",
                       "1.5", "--min-changes", "6", "--max-tokens", "12", "--server-args", "--num-threads 1"])
    summary = run(args, tmp_path)
    assert summary["failed"] == 0, summary["failures"]
    assert summary["mismatched"] == 0, summary["mismatches"]
    assert set(summary["changes"]) == {"switch", "drain", "leave", "join"}, summary["change_log"]
    assert all(not any(left.values()) for left in summary["kv_left"].values()), summary["kv_left"]
