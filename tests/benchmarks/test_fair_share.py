"""The fair-share benchmark end to end against a real server of a tiny model, small: it
prints and writes each repetition's latencies beside a one-sequence and a many-sequence
request, and their ratios (what they are is the benchmark's figure, not the test's)."""

from __future__ import annotations

import json

import pytest

from benchmarks.fair_share import main

pytestmark = pytest.mark.slow


def test_the_benchmark_reports_each_repetition_and_the_median_ratios(tiny_models, tmp_path, capsys) -> None:
    out = tmp_path / "fair.json"
    assert main(["--model", str(tiny_models["qwen3"]), "--n", "8", "--long-tokens", "200", "--requests", "6",
                 "--settle", "0.5", "--repeats", "2", "--server-args", "--num-threads 1", "--output", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["n"] == 8 and len(figures["repetitions"]) == 2
    for rep in figures["repetitions"]:
        for side in ("one", "many"):
            assert 0 < rep[side]["p50_ms"] <= rep[side]["p99_ms"]
        assert rep["ratio_p99"] == pytest.approx(rep["many"]["p99_ms"] / rep["one"]["p99_ms"])
    printed = capsys.readouterr().out
    assert printed.count("rep ") == 2 and "median ratios: p50" in printed
