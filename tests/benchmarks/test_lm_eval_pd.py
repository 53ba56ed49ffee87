"""benchmarks/lm_eval_pd.py's tasks (lm-eval itself is installed apart, so only what the
runner hands it is checked here): the YAMLs name the repository's data files, and the
data are well formed."""

from __future__ import annotations

import json

from benchmarks import lm_eval_pd


def test_the_tasks_name_the_local_data_files(tmp_path) -> None:
    tasks = lm_eval_pd.task_dir(tmp_path)
    for name, data in (("pd_mc", "mc.jsonl"), ("pd_gen", "gen.jsonl")):
        text = (tasks / f"{name}.yaml").read_text()
        assert f"task: {name}" in text and "DATA_DIR" not in text
        assert str(lm_eval_pd.TASKS_DIR / "data" / data) in text
    questions = [json.loads(line) for line in (lm_eval_pd.TASKS_DIR / "data" / "mc.jsonl").open()]
    assert len(questions) == 40 and all(0 <= q["answer"] < len(q["choices"]) == 4 for q in questions)
    completions = [json.loads(line) for line in (lm_eval_pd.TASKS_DIR / "data" / "gen.jsonl").open()]
    assert len(completions) == 40 and all(c["prompt"] and c["target"] for c in completions)
