"""benchmarks/canary.py end to end on a tiny model, small: the agreement run counts an
outcome for every request, the latency run reports every round and the ratios (what the
figures are is the benchmark's to say, not the test's)."""

from __future__ import annotations

import json

import pytest

from benchmarks.canary import RESULTS, main

pytestmark = pytest.mark.slow


def test_agreement_counts_an_outcome_per_request(tiny_models, tmp_path) -> None:
    out = tmp_path / "canary.json"
    result = main(["--model", str(tiny_models["qwen3"]), "--requests", "6", "--new-tokens", "4", "--output", str(out)])
    assert json.loads(out.read_text()) == result
    assert set(result["outcomes"]) == set(RESULTS) and sum(result["outcomes"].values()) == 6


def test_latency_reports_each_round_and_the_ratios(tiny_models, capsys) -> None:
    result = main(["--model", str(tiny_models["qwen3"]), "--latency", "--requests", "4", "--new-tokens", "4",
                   "--repeats", "2", "--fraction", "1"])
    assert len(result["rounds"]) == 2 and set(result["median_ratios"]) == {"p50", "p99"}
    assert all(r[side]["p50_ms"] > 0 for r in result["rounds"] for side in ("off", "canary"))
    assert capsys.readouterr().out.count("round ") == 2
