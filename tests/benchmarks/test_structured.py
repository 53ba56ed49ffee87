"""benchmarks/structured.py on a tiny tokenizer: every grammar kind walks its valid
output to the grammar's end, with its costs in the table and the JSON."""

from __future__ import annotations

import json

from benchmarks import structured
from pd.models.make_model import make_model


def test_every_grammar_walks_to_its_end(tmp_path, capsys) -> None:
    model = make_model("qwen3", tmp_path / "qwen3", seed=0)
    out = tmp_path / "structured.json"
    rows = structured.main(["--model", str(model), "--output", str(out)])
    assert [r["grammar"] for r in rows] == list(structured.CASES)
    for row in rows:
        assert row["stopped_at_the_end"] or row["grammar"] in ("json_object", "regex"), row  # those may go on
        assert row["tokens"] > 0 and row["mask_us_p50"] > 0 and row["compile_again_ms"] > 0
    assert json.loads(out.read_text())["rows"] == rows
    assert "| json_schema |" in capsys.readouterr().out
