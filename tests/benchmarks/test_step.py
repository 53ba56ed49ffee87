"""`pd bench step` on a tiny checkpoint: a decode step broken into parts that add up to
the step, with page faults counted, printed as a table and saved as JSON."""

from __future__ import annotations

import json

import pytest

from benchmarks import step
from cli.main import main
from pd.models.make_model import make_model


def test_bench_step_breaks_a_decode_step_down(tmp_path, capsys) -> None:
    model = make_model("gemma3", tmp_path / "gemma3", seed=0)
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--model", str(model), "--batch", "3", "--context", "40", "--steps", "4",
                 "--warmup", "1", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["batch"], result["context"], len(result["per_step"])) == (3, 40, 4)
    for record in result["per_step"]:
        parts = [record[k] for k in ("attention", "mlp", "lm_head", "sampling", "scheduler")]
        assert all(p > 0 for p in parts) and sum(parts) <= record["step"]  # measured inside the step
        assert record["faults"] >= 0
    assert result["medians"]["step"] > 0 and result["medians"]["step_modules"] > 0  # native plans, then modules
    table = capsys.readouterr().out
    assert "| attention |" in table and "step as served" in table and "minor page faults per step" in table


def test_bench_step_help_names_its_flags(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        step.main(["--help"], prog="pd bench step")
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: pd bench step") and "--context" in out and "--batch" in out
