"""`pd bench step` on a tiny checkpoint: a decode step broken into parts that add up to
the step, with page faults counted, printed as a table and saved as JSON."""

from __future__ import annotations

import json

import pytest

from benchmarks import step
from cli.main import main
from pd.models.make_model import make_model

# the machine's figures as `python -m benchmarks.peaks --output` writes them: made up, so that
# the bounds below are exact arithmetic (GMAC/s and GB/s, all threads)
MACHINE = {"int8 dot (vpdpbusd)": {"all_threads": 400.0}, "bfloat16 dot (vdpbf16ps)": {"all_threads": 200.0},
           "float32 FMA (vfmadd)": {"all_threads": 100.0},
           "memory": {"read": {"all_threads": 20.0}, "copy": {"all_threads": 15.0}}}


def test_bench_step_breaks_a_decode_step_down_and_reads_it_against_the_machine(tmp_path, capsys) -> None:
    model = make_model("gemma3", tmp_path / "gemma3", seed=0)
    out, machine = tmp_path / "step.json", tmp_path / "peaks.json"
    machine.write_text(json.dumps(MACHINE))
    assert main(["bench", "step", "--model", str(model), "--batch", "3", "--context", "200", "--steps", "4",
                 "--warmup", "1", "--peaks", str(machine), "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["batch"], result["context"], len(result["per_step"])) == (3, 200, 4)
    # tiny gemma3, float32: 6 layers of q, k, v, o (256 -> 256, 128, 128; 256 -> 256), gate and up
    # (256 -> 512) and down (512 -> 256), and the lm_head (256 -> 4096, tied to the embedding)
    linear_weights = 6 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512) + 256 * 4096
    work = result["work"]
    assert work["weights"] == {"float32": 4 * linear_weights}
    assert work["macs"] == {"float32 FMA (vfmadd)": 3 * linear_weights}
    # K and V of 2 heads of 64 float32 a token: 2 full layers see all 200 tokens, 4 sliding ones their 128
    assert work["kv"] == 3 * (2 * 2 * 64 * 4) * (2 * 200 + 4 * 128)
    step_bound = max((4 * linear_weights + work["kv"]) / 20e9, 3 * linear_weights / 100e9)
    assert result["bounds"]["step"]["bound"] == pytest.approx(step_bound)
    assert result["bounds"]["step"]["fraction"] == pytest.approx(step_bound / result["medians"]["step"])
    assert result["bounds"]["lm_head"]["bound"] == pytest.approx(max(4 * 256 * 4096 / 20e9, 3 * 256 * 4096 / 100e9))
    for record in result["per_step"]:
        parts = [record[k] for k in ("attention", "mlp", "lm_head", "sampling", "scheduler")]
        assert all(p > 0 for p in parts) and sum(parts) <= record["step"]  # measured inside the step
        assert record["faults"] >= 0
    assert result["medians"]["step"] > 0 and result["medians"]["step_modules"] > 0  # native plans, then modules
    # the linears and the lm_head read against their bound as served (their forward timed, no hooks): inside the
    # served step, the lm_head's linear among the linears
    m = result["medians"]
    assert 0 < m["lm_head"] < m["step"] and 0 < m["linears"] < m["step"] and m["linears_modules"] > 0
    assert result["bounds"]["linears"]["fraction"] == pytest.approx(result["bounds"]["linears"]["bound"] / m["linears"])
    table = capsys.readouterr().out
    assert "| attention |" in table and "step as served" in table and "minor page faults per step" in table
    assert "| every linear, as served |" in table and "memory reads 20.0 GB/s here" in table


def test_bench_step_help_names_its_flags(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        step.main(["--help"], prog="pd bench step")
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: pd bench step") and "--context" in out and "--batch" in out


def _machine(read: float, int8: float) -> dict:
    """MACHINE with its read bandwidth and int8 peak (all threads) replaced."""
    machine = json.loads(json.dumps(MACHINE))
    machine["memory"]["read"]["all_threads"], machine["int8 dot (vpdpbusd)"]["all_threads"] = read, int8
    return machine


def test_the_machine_is_the_faster_of_two_measurements_figure_by_figure() -> None:
    slow_memory, slow_arithmetic = _machine(read=35.0, int8=500.0), _machine(read=62.0, int8=450.0)
    slow_memory["memory"]["read"]["one_thread"], slow_arithmetic["memory"]["read"]["one_thread"] = 30.0, 20.0
    best = step.faster(slow_memory, slow_arithmetic)
    assert best["memory"]["read"] == {"all_threads": 62.0, "one_thread": 30.0}
    assert best["int8 dot (vpdpbusd)"]["all_threads"] == 500.0
    assert best["memory"]["copy"] == MACHINE["memory"]["copy"] and best == step.faster(slow_arithmetic, slow_memory)


def test_bench_step_measures_the_machine_before_and_after_and_reads_against_the_faster(tmp_path, monkeypatch,
                                                                                     capsys) -> None:
    # these machines' memory moves between ~35 and ~62 GB/s within minutes: a bound measured once, in a slow
    # minute, rated a step run in a fast one past its limit (a fraction of 1.47 on the real Gemma's lm_head)
    measured = iter([_machine(read=20.0, int8=400.0), _machine(read=50.0, int8=400.0)])
    monkeypatch.setattr(step, "measure_machine", lambda threads: next(measured))
    model = make_model("gemma3", tmp_path / "gemma3", seed=0)
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--model", str(model), "--batch", "2", "--context", "64", "--steps", "2",
                 "--warmup", "1", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert next(measured, None) is None  # both taken: before the model loaded and after the steps
    assert result["read_gbps_measured"] == [20.0, 50.0] and result["bounds"]["read_gbps"] == 50.0
    work = result["work"]
    nbytes = sum(work["weights"].values()) + work["kv"]
    step_bound = max(nbytes / 50e9, sum(work["macs"].values()) / 100e9)  # float32 linears: the FMA peak
    assert result["bounds"]["step"]["bound"] == pytest.approx(step_bound)
    assert "memory reads 20.0 GB/s here before the steps and 50.0 after (the bounds take the faster)" in \
        capsys.readouterr().out
