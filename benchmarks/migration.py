"""`python -m benchmarks.migration --model M`: a decode server failing mid-stream behind
the proxy, and whether any client noticed (proxy/migration.py).

One prefill and `--decode` decode servers (NIXL) behind `pd proxy --policy round_robin`.
`--requests` requests of a cycle of kinds (greedy, seeded at temperature 0.8, logprobs=5
with penalties, a stop string, a JSON schema, chat with top_logprobs=5, echo, n=2;
streamed and not; completions in place of chat for a model without a chat template)
are each run alone first (the uninterrupted reference), then all at once; once every
stream has had `--after` chunks, the decode server with most requests in flight fails
(`--fault kill`: SIGKILL; `engine`: its engine process is killed, and the server says
so; `drain`: SIGTERM, and the server drains, handing its streams on with their KV, which
the other decode servers read: their prompt tokens computed for them are counted, and
should be 0). What is checked, per request: it completed (200, no error event), its text, token
ids and finish reason equal the reference's, logprobs within 1e-4, `usage` the same
counts, one chunk id per stream; and after, every server left holds no KV. Prints a
JSON summary (with each stream's longest pause between chunks against the median gap
between two chunks, a decode step, and the proxy's migration counters) and exits 1 on
any difference.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import launch
from launch import free_port, http_client, pd_command

TIMEOUT_S = 300.0
PROMPT = "The lighthouse keeper counted the ships that passed the rocks each night, and"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
          "required": ["name", "count"]}
CHAT = {"messages": [{"role": "user", "content": PROMPT}]}
STREAMED = {"stream": True, "stream_options": {"include_usage": True}}
KINDS = {  # name -> body (max_tokens added)
    "greedy": {"prompt": PROMPT, "temperature": 0, "ignore_eos": True} | STREAMED,
    "seeded": {"prompt": PROMPT, "temperature": 0.8, "seed": 7, "ignore_eos": True, "return_token_ids": True}
    | STREAMED,
    "logprobs-penalties": {"prompt": PROMPT, "temperature": 0.8, "seed": 3, "ignore_eos": True, "logprobs": 5,
                           "frequency_penalty": 1.0, "presence_penalty": 0.5, "repetition_penalty": 1.2} | STREAMED,
    "chat-logprobs": CHAT | {"temperature": 0.8, "seed": 5, "ignore_eos": True, "logprobs": True,
                             "top_logprobs": 5} | STREAMED,
    "json-schema": CHAT | {"temperature": 0.7, "seed": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "ship", "schema": SCHEMA}}} | STREAMED,
    "stop": {"prompt": PROMPT, "temperature": 1.0, "seed": 11, "ignore_eos": True, "stop": ["zz", "qq", " the"]}
    | STREAMED,
    "chat-greedy": CHAT | {"temperature": 0, "ignore_eos": True} | STREAMED,
    "echo": {"prompt": PROMPT, "temperature": 0.8, "seed": 9, "ignore_eos": True, "echo": True, "logprobs": 2}
    | STREAMED,
    "stream-n2": CHAT | {"temperature": 0.8, "seed": 12, "ignore_eos": True, "n": 2, "return_token_ids": True}
    | STREAMED,
    "whole-greedy": {"prompt": PROMPT, "temperature": 0, "ignore_eos": True},
    "whole-n2": CHAT | {"temperature": 0.8, "seed": 4, "ignore_eos": True, "n": 2},
}


def bodies(count: int, max_tokens: int, chat: bool = True) -> list[tuple[str, dict]]:
    """`count` requests, the kinds in turn, each seeded one with a seed of its own; with
    `chat` False (a model without a chat template), completions in place of chat."""
    out = []
    for i in range(count):
        name = list(KINDS)[i % len(KINDS)]
        body = KINDS[name] | {"max_tokens": max_tokens}
        if "seed" in body:
            body["seed"] += i
        out.append((name, body if chat else as_completion(body)))
    return out


def as_completion(body: dict) -> dict:
    """A chat body as a completion of the same prompt (its logprobs as completions ask)."""
    if "messages" not in body:
        return body
    out = {k: v for k, v in body.items() if k not in ("messages", "logprobs", "top_logprobs")} | {"prompt": PROMPT}
    if body.get("logprobs"):
        out["logprobs"] = body.get("top_logprobs", 0)
    return out


def has_chat_template(url: str) -> bool:
    response = http_client().post(f"{url}/v1/chat/completions", timeout=TIMEOUT_S,
                                  json=CHAT | {"max_tokens": 1})
    return response.status_code == 200


def endpoint(body: dict) -> str:
    return "chat/completions" if "messages" in body else "completions"


class Answer:
    """One request's answer as its client saw it, read on a thread: each choice merged
    (text, token ids when asked, logprobs, finish reason), the usage, every chunk id, the
    error events, and the longest pause between two chunks."""

    def __init__(self) -> None:
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: dict | None = None
        self.ids: set = set()
        self.errors: list[dict] = []
        self.chunks = 0
        self.status: int | None = None
        self.longest_pause_s = 0.0
        self.gaps: list[float] = []  # seconds between two chunks

    def add(self, choice: dict) -> None:
        merged = self.choices.setdefault(choice.get("index", 0), {"text": "", "token_ids": [], "logprobs": [],
                                                                  "finish_reason": None})
        merged["text"] += choice.get("text") or (choice.get("delta") or {}).get("content") or \
            (choice.get("message") or {}).get("content") or ""
        merged["token_ids"] += choice.get("token_ids") or []
        logprobs = choice.get("logprobs") or {}
        merged["logprobs"] += logprobs.get("token_logprobs") or [e["logprob"] for e in logprobs.get("content") or []]
        merged["finish_reason"] = choice.get("finish_reason") or merged["finish_reason"]

    def counts(self) -> dict | None:
        return None if self.usage is None else {k: self.usage[k] for k in ("prompt_tokens", "completion_tokens")}


def read(url: str, body: dict, answer: Answer | None = None) -> Answer:
    """`body`'s answer from the server or proxy at `url` (streamed or not, as it asks)."""
    answer = answer or Answer()
    if not body.get("stream"):
        response = http_client().post(f"{url}/v1/{endpoint(body)}", json=body, timeout=TIMEOUT_S)
        answer.status = response.status_code
        if response.status_code == 200:
            whole = response.json()
            answer.usage, answer.ids = whole["usage"], {whole["id"]}
            for choice in whole["choices"]:
                answer.add(choice)
        else:
            answer.errors.append(response.json())
        return answer
    with http_client().stream("POST", f"{url}/v1/{endpoint(body)}", json=body, timeout=TIMEOUT_S) as response:
        answer.status = response.status_code
        last = time.monotonic()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            now, chunk = time.monotonic(), json.loads(line[6:])
            if answer.chunks:
                answer.gaps.append(now - last)
            answer.longest_pause_s, last = max(answer.longest_pause_s, now - last), now
            answer.chunks += 1
            if "error" in chunk:
                answer.errors.append(chunk)
                continue
            answer.ids.add(chunk.get("id"))
            answer.usage = chunk.get("usage") or answer.usage
            for choice in chunk.get("choices") or []:
                answer.add(choice)
    return answer


def differences(got: Answer, want: Answer, atol: float = 1e-4) -> list[str]:
    """How `got` differs from `want` (empty: it does not)."""
    out = []
    if got.status != 200 or got.errors:
        return [f"failed: HTTP {got.status}, {got.errors[:1]}"]
    if len(got.ids) != 1:
        out.append(f"{len(got.ids)} chunk ids")
    if got.counts() != want.counts():
        out.append(f"usage {got.counts()} != {want.counts()}")
    for index, expected in want.choices.items():
        choice = got.choices.get(index, {})
        for key in ("text", "token_ids", "finish_reason"):
            if choice.get(key) != expected[key]:
                out.append(f"choice {index}: {key} differs")
        logprobs, wanted = choice.get("logprobs", []), expected["logprobs"]
        if len(logprobs) != len(wanted) or any(  # an echoed prompt's first token has None
                a != b if a is None or b is None else abs(a - b) > atol for a, b in zip(logprobs, wanted)):
            out.append(f"choice {index}: logprobs differ by more than {atol}")
    return out


def proxy_metrics(url: str, prefix: str = "pd_proxy_migrat") -> dict[str, float]:
    text = http_client().get(f"{url}/metrics", timeout=10).text
    return {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in text.splitlines()
            if line.startswith(prefix) and not line.startswith("#") and "_created" not in line}


def busiest_decode(proxy: str, among: set[str] | None = None) -> str:
    """The decode server (of `among`, if given) with most requests in flight, as the
    proxy counts them."""
    decode = [i for i in http_client().get(f"{proxy}/health", timeout=10).json()["decode"]
              if among is None or i["url"] in among]
    return max(decode, key=lambda i: i["outstanding"])["url"]


def run(model: Path, workdir: Path, decode: int = 2, requests: int = 24, max_tokens: int = 96, after: int = 4,
        fault: str = "kill", server_args: tuple[str, ...] = ("--num-threads", "1")) -> dict:
    """The run `--help` describes; its summary."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    launch.deployment_secret()
    with contextlib.ExitStack() as stack:
        def start(name: str, *args: str) -> launch.Launched:
            port = free_port()
            cmd = pd_command("serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port), *args,
                             *server_args)
            launched = launch.start(cmd, f"http://127.0.0.1:{port}", workdir / f"{name}.log", wait=False)
            stack.callback(launch.stop_process, launched.process)
            return launched

        p = start("p", "--role", "prefill")
        ds = {d.url: d for d in (start(f"d{i}", "--role", "decode") for i in range(decode))}
        launch.wait_started(p, *ds.values())
        port = free_port()
        proxy = launch.start(pd_command("proxy", "--host", "127.0.0.1", "--port", str(port), "--prefill", p.url,
                                        "--decode", *ds, "--policy", "round_robin", "--probe-interval", "3600"),
                             f"http://127.0.0.1:{port}", workdir / "proxy.log", ready=lambda s: s in (200, 503))
        stack.callback(launch.stop_process, proxy.process)
        work = bodies(requests, max_tokens, chat=has_chat_template(proxy.url))
        reference = [read(proxy.url, body) for _, body in work]
        answers = [Answer() for _ in work]
        with ThreadPoolExecutor(len(work)) as pool:
            futures = [pool.submit(read, proxy.url, body, answer) for (_, body), answer in zip(work, answers)]
            streams = [(a, f) for (_, body), a, f in zip(work, answers, futures) if body.get("stream")]
            deadline = time.monotonic() + TIMEOUT_S
            while not all(a.chunks >= after or f.done() for a, f in streams) and time.monotonic() < deadline:
                time.sleep(0.02)
            victim = ds[busiest_decode(proxy.url)]
            in_flight = _outstanding(proxy.url, victim.url)
            others = [d for d in ds.values() if d is not victim]
            computed = sum(_computed_prompt_tokens(d.url) for d in others)
            failed_at = time.monotonic()
            _fail(victim, fault)
            victim.process.wait(TIMEOUT_S)
            exited_s = time.monotonic() - failed_at
            for future in futures:
                future.result()
        ended_s = time.monotonic() - failed_at
        left = [p, *(d for d in ds.values() if d is not victim)]
        kv_left = {s.url: _kv_usage(s.url) for s in left}
        problems = {f"{i} {name}": diff for i, ((name, _), got, want) in enumerate(zip(work, answers, reference))
                    if (diff := differences(got, want))}
        streamed = [a for (_, body), a in zip(work, answers) if body.get("stream")]
        return {"model": str(model), "fault": fault, "requests": len(work), "failed_server": victim.url,
                "requests_on_it_at_the_fault": in_flight,
                "completed": sum(a.status == 200 and not a.errors for a in answers),
                "equal": len(work) - len(problems), "problems": problems,
                "seconds_to_the_last_answer_after_the_fault": round(ended_s, 2),
                "seconds_until_the_failed_server_exited": round(exited_s, 2),
                "prompt_tokens_computed_by_the_others_after_the_fault":
                    sum(_computed_prompt_tokens(d.url) for d in others) - computed,
                "longest_pause_s": sorted(round(a.longest_pause_s, 3) for a in streamed),
                "median_gap_between_chunks_s": round(statistics.median(g for a in streamed for g in a.gaps), 4),
                "kv_usage_left": kv_left, "proxy": proxy_metrics(proxy.url)}


def _fail(victim: launch.Launched, fault: str) -> None:
    """`fault` (`--fault`) done to a decode server this run started."""
    if fault == "kill":
        victim.process.send_signal(signal.SIGKILL)
    elif fault == "drain":
        victim.process.send_signal(signal.SIGTERM)
    else:
        os.kill(victim.health().json()["engine_pid"], signal.SIGKILL)  # its child


def _outstanding(proxy: str, url: str) -> int:
    """The requests in flight at a decode server, as the proxy counts them."""
    decode = http_client().get(f"{proxy}/health", timeout=10).json()["decode"]
    return next(i["outstanding"] for i in decode if i["url"] == url)


def _computed_prompt_tokens(url: str) -> float:
    """A server's prompt tokens computed so far (not read, nor found in its cache)."""
    return proxy_metrics(url, "pd_prompt_tokens_by_source_total").get(
        'pd_prompt_tokens_by_source_total{source="computed"}', 0.0)


def _kv_usage(url: str, wait_s: float = 30.0) -> float:
    deadline = time.monotonic() + wait_s
    while True:
        usage = proxy_metrics(url, "pd_kv_cache_usage").get("pd_kv_cache_usage", 0.0)
        if usage == 0 or time.monotonic() > deadline:
            return usage
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.migration", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="model directory or GGUF file")
    parser.add_argument("--decode", type=int, default=2, help="decode servers, at least 2 (default 2)")
    parser.add_argument("--requests", type=int, default=24, help="requests in all (default 24)")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens each request generates (default 96)")
    parser.add_argument("--after", type=int, default=4, help="chunks every stream has had at the fault (default 4)")
    parser.add_argument("--fault", choices=("kill", "engine", "drain"), default="kill",
                        help="kill: SIGKILL the busiest decode server; engine: kill its engine process; drain: "
                             "SIGTERM it, so that it hands its streams on with their KV (default kill)")
    parser.add_argument("--server-args", default="--num-threads 1", help="more flags for every server")
    parser.add_argument("--workdir", type=Path, default=None, help="logs go here (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.decode < 2:
        parser.error("--decode must be at least 2: one fails, another takes its requests")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="pd-migration-"))
    workdir.mkdir(parents=True, exist_ok=True)
    summary = run(args.model, workdir, args.decode, args.requests, args.max_tokens, args.after, args.fault,
                  tuple(args.server_args.split()))
    print(json.dumps(summary, indent=1))
    ok = summary["equal"] == summary["requests"] and not any(summary["kv_usage_left"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
