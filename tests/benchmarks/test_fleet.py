"""`pd bench fleet` on the tiny qwen3: two short phases, a static split, colocated and the
planner, one run each; the figures per phase, the files it writes, and flags it refuses."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks.fleet import configs_of, main, parse_phases, workload

pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def test_phases_and_configurations_are_parsed_and_the_workload_is_one_for_all() -> None:
    phases = parse_phases("a:rate=4,input=32,output=4,seconds=2; b:rate=5,input=8,output=16,seconds=3")
    assert [(p.name, p.rate, p.seconds) for p in phases] == [("a", 4.0, 2.0), ("b", 5.0, 3.0)]
    samples, offsets, names = workload(phases, 0, 1000)
    assert offsets == sorted(offsets) and all(t < 2 for t, n in zip(offsets, names) if n == "a")
    assert {s.prompt_len for s, n in zip(samples, names) if n == "b"} == {8}
    assert workload(phases, 0, 1000)[1] == offsets  # the same for every configuration
    for bad in ("a:rate=1", "a:rate=0,input=1,output=1,seconds=1", "", ":rate=1,input=1,output=1,seconds=1"):
        with pytest.raises(ValueError):
            parse_phases(bad)

    class Args:
        servers, configs = 3, None

    assert configs_of(Args) == ["planner", "colocated", "1p2d", "2p1d"]
    Args.configs = "3p0d"
    with pytest.raises(ValueError, match="unknown"):
        configs_of(Args)


def test_a_short_run_reports_every_phase_of_every_configuration(tiny_models, tmp_path) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    results = main(["--model", str(tiny_models["qwen3"]), "--servers", "3", "--configs", "1p2d,colocated,planner",
                    "--phases", "long:rate=6,input=96,output=4,seconds=3;chat:rate=3,input=16,output=24,seconds=3",
                    "--repetitions", "1", "--ttft-slo", "5", "--tpot-slo", "1", "--vocab-size", "4000",
                    "--output-dir", str(tmp_path)])
    assert set(results) == {"1p2d", "colocated", "planner"}
    for figures in results.values():
        assert figures["all"]["failed"] == 0 and figures["all"]["requests"] > 0, figures["all"]["errors"]
        assert figures["long"]["attainment"] == 1.0 and figures["chat"]["goodput"] > 0
    saved = json.loads((tmp_path / "fleet.json").read_text())
    assert saved["medians"]["planner"]["long"]["requests"] == results["1p2d"]["long"]["requests"]
    assert (tmp_path / "fleet.png").stat().st_size > 0 and "| planner |" in (tmp_path / "fleet.md").read_text()
    assert "planning http" in (tmp_path / "planner-rep0.log").read_text()
