"""benchmarks/offline.py: pd.LLM against transformers' generate, on a tiny architecture
and on a checkpoint named with --model; rows for both engines, a table, a JSON file."""

from __future__ import annotations

import json

from benchmarks import offline
from pd.models.make_model import make_model

FAST = ["--batch-sizes", "2", "--input-len", "8", "--output-len", "4"]


def test_tiny_architecture_and_a_named_checkpoint(tmp_path, capsys) -> None:
    rows = offline.main(["--archs", "qwen3", *FAST, "--output", str(tmp_path / "a.json")])
    assert {(r["arch"], r["engine"]) for r in rows} == {("qwen3", "pd"), ("qwen3", "transformers")}
    model = make_model("gemma3", tmp_path / "my-gemma", seed=0)
    rows = offline.main(["--model", str(model), *FAST, "--output", str(tmp_path / "b.json")])
    assert {(r["arch"], r["engine"]) for r in rows} == {("my-gemma", "pd"), ("my-gemma", "transformers")}
    assert all(r["output_tokens_per_s"] > 0 for r in rows)
    assert json.loads((tmp_path / "b.json").read_text())["rows"] == rows
    assert "| my-gemma | pd |" in capsys.readouterr().out
