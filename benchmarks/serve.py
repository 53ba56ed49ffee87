"""Online serving benchmark against any OpenAI-compatible server, over HTTP only.

Requests from a dataset (`benchmarks/datasets.py`) arrive as a gamma process (Poisson
at `--burstiness 1`, all at once at `--request-rate inf`), at most `--max-concurrency`
in flight, each streamed with `stream_options.include_usage`. Per request it records the
start, TTFT (first content chunk), every inter-token gap between content chunks (ITL),
end-to-end latency (E2EL) and the server's usage counts. Aggregates follow vLLM's
`benchmark_serving`: failed requests are left out of every figure except the failed count
and peak concurrency; TPOT is (E2EL - TTFT) / (output_len - 1) over requests with more
than one output token; ITL percentiles are over all gaps of all requests; a request counts
towards goodput when it meets every given SLO (TPOT taken as 0 for one-token outputs).
`/metrics` is scraped before and after for prefix-cache hit rates and KV transfer bytes.
The requests done (and the time left) are shown on stderr as they end: a bar on a
terminal, a few plain lines otherwise (`telemetry.progress`); stdout holds the result alone.

    python -m benchmarks.serve --base-url http://127.0.0.1:8000 --num-prompts 200 \\
        --request-rate 4 --max-concurrency 32 --ignore-eos --save-result

A chunk whose text is empty (a role header, a token that decodes to nothing) is not a
content chunk; when a server sends several tokens in one chunk, that chunk is one gap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from contextlib import nullcontext
from datetime import datetime
from pathlib import Path
from typing import Sequence

import httpx

from benchmarks.datasets import SampleRequest, add_dataset_args, load_samples
from benchmarks.serve_metrics import (
    SLO_NAMES,
    RequestRecord,
    Samples,
    arrival_intervals,
    compute_metrics,
    parse_prometheus,
    send_offsets,
    server_metric_deltas,
)
from proxy.body import prefill_body
from telemetry.progress import Progress
from wire.kv_params import KV_TRANSFER_PARAMS

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


# ---------------------------------------------------------------- HTTP client


def build_payload(endpoint: str, model: str, sample: SampleRequest, ignore_eos: bool) -> dict:
    payload: dict = {"model": model, "max_tokens": sample.output_len, "temperature": 0.0,
                     "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "/v1/chat/completions":
        payload["messages"] = [{"role": "user", "content": sample.text()}]
    else:
        payload["prompt"] = sample.prompt
    if ignore_eos:
        payload["ignore_eos"] = True
    return payload


def _chunk_text(data: dict) -> str:
    choices = data.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        delta = choice["delta"] or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def prefill_remotely(client: httpx.AsyncClient, prefill_url: str, payload: dict) -> dict:
    """Send the request to a prefill server first, with the body the proxy sends
    (`proxy.body.prefill_body`); the payload for the decode server, carrying P's
    kv_transfer_params."""
    response = await client.post(prefill_url, json=prefill_body(payload))
    if response.status_code != 200:
        raise RuntimeError(f"prefill HTTP {response.status_code}: {response.text[:500]}")
    return payload | {KV_TRANSFER_PARAMS: response.json()[KV_TRANSFER_PARAMS]}


async def send_request(client: httpx.AsyncClient, url: str, payload: dict, prompt_len: int,
                       t0: float, prefill_url: str | None = None) -> RequestRecord:
    """Stream one request (after prefilling it at `prefill_url`, when given: TTFT then
    includes the prefill server's answer); every failure ends up in `record.error`,
    never raised."""
    record = RequestRecord(prompt_len=prompt_len, start=time.perf_counter() - t0)
    try:
        if prefill_url is not None:
            payload = await prefill_remotely(client, prefill_url, payload)
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:500]}"
            else:
                await _read_stream(response, record, t0)
    except Exception as exc:  # any failure is this request's result, not the run's end
        record.error = f"{type(exc).__name__}: {exc}"
    record.end = time.perf_counter() - t0
    record.success = record.error is None
    return record


async def _read_stream(response: httpx.Response, record: RequestRecord, t0: float) -> None:
    last = first_choice = None
    chunks = 0
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        body = line[len("data:"):].strip()
        if body == "[DONE]":
            break
        data = json.loads(body)
        if data.get("error"):
            record.error = f"stream error: {data['error']}"
            return
        if data.get("choices") and first_choice is None:
            first_choice = time.perf_counter() - t0
        for choice in data.get("choices") or []:
            record.token_ids += choice.get("token_ids") or []
        if _chunk_text(data):
            now = time.perf_counter() - t0
            if last is None:
                record.ttft = now - record.start
            else:
                record.itl.append(now - last)
            last, chunks = now, chunks + 1
        if usage := data.get("usage"):
            if usage.get("completion_tokens") is not None:
                record.output_len, record.output_len_from_usage = usage["completion_tokens"], True
            record.prompt_len = usage.get("prompt_tokens") or record.prompt_len
    if chunks == 0 and record.output_len_from_usage and record.output_len > 0 and first_choice is not None:
        record.ttft = first_choice - record.start  # tokens that decode to no text (e.g. special tokens)
    elif chunks == 0:
        record.error = "stream ended without content"
    elif not record.output_len_from_usage:
        record.output_len = chunks


async def run_requests(client: httpx.AsyncClient, url: str, payloads: list[dict],
                       samples: list[SampleRequest], offsets: list[float],
                       max_concurrency: int | None, prefill_url: str | None = None,
                       label: str = "pd") -> tuple[list[RequestRecord], float]:
    """Send request i at `offsets[i]` seconds (or later, once a concurrency slot frees)."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else nullcontext()
    progress = Progress(f"bench serve {label}", len(payloads), "requests")  # on stderr
    t0 = time.perf_counter()

    async def one(i: int) -> RequestRecord:
        await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
        async with limit:
            record = await send_request(client, url, payloads[i], samples[i].prompt_len, t0, prefill_url)
            record.turn = samples[i].turn
        progress.update(1)
        return record

    records = await asyncio.gather(*(one(i) for i in range(len(payloads))))
    duration = time.perf_counter() - t0
    progress.close()
    return list(records), duration


async def run_conversations(client: httpx.AsyncClient, url: str, payloads: list[dict],
                            samples: list[SampleRequest], offsets: list[float],
                            max_concurrency: int | None, prefill_url: str | None = None,
                            label: str = "pd") -> tuple[list[RequestRecord], float]:
    """Multi-turn, closed loop: each conversation starts at its first turn's offset and
    sends its next turn once the last is answered, the prompt being the last prompt, the
    model's answer (the token ids the server returned; the dataset's stand-in where it
    returned none) and the turn's new message. At most `max_concurrency` requests in
    flight; a conversation between turns holds no slot."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else nullcontext()
    progress = Progress(f"bench serve {label}", len(payloads), "requests")  # on stderr
    records: list[RequestRecord] = [RequestRecord(prompt_len=s.prompt_len) for s in samples]
    conversations: dict[int, list[int]] = {}
    for i, sample in enumerate(samples):
        conversations.setdefault(sample.conversation, []).append(i)
    t0 = time.perf_counter()

    async def conversation(turns: list[int]) -> None:
        await asyncio.sleep(max(0.0, t0 + offsets[turns[0]] - time.perf_counter()))
        prompt, last = list(samples[turns[0]].prompt), samples[turns[0]]
        for k, i in enumerate(turns):
            sample = samples[i]
            if k:
                stand_in = sample.prompt[len(last.prompt):len(sample.prompt) - len(sample.message)]
                answer = records[turns[k - 1]].token_ids or stand_in
                prompt = prompt + answer + sample.message
            async with limit:
                record = await send_request(client, url, payloads[i] | {"prompt": prompt, "return_token_ids": True},
                                            len(prompt), t0, prefill_url)
            record.turn, records[i], last = sample.turn, record, sample
            progress.update(1)

    await asyncio.gather(*(conversation(turns) for turns in conversations.values()))
    duration = time.perf_counter() - t0
    progress.close()
    return records, duration


async def scrape_metrics(client: httpx.AsyncClient, url: str) -> Samples | None:
    try:
        response = await client.get(url)
    except httpx.HTTPError:
        return None
    return parse_prometheus(response.text) if response.status_code == 200 else None


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


# ---------------------------------------------------------------- CLI


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] → {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_NAMES or float(value) < 0:
            raise ValueError(f"bad --goodput item {item!r}: want NAME:MS with NAME in {SLO_NAMES}")
        slos[name] = float(value)
    return slos


def arrivals(samples: list[SampleRequest], args: argparse.Namespace) -> list[float]:
    """When each request is sent, in seconds after the start: a trace's own times, else
    gaps drawn for --request-rate and --burstiness."""
    if samples and all(s.arrival is not None for s in samples):
        return [s.arrival for s in samples]
    return send_offsets(arrival_intervals(len(samples), args.request_rate, args.burstiness, args.seed))


def closed_loop(args: argparse.Namespace) -> bool:
    """Whether the run is a closed-loop multi-turn one (ValueError where it cannot be)."""
    if args.dataset != "multi-turn" or args.multi_turn_loop != "closed":
        return False
    if args.endpoint != "/v1/completions":
        raise ValueError("--multi-turn-loop closed sends token ids: it needs --endpoint /v1/completions")
    return True


async def benchmark(args: argparse.Namespace) -> dict:
    slos = parse_goodput(args.goodput)
    samples = load_samples(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency,
                          max_keepalive_connections=args.max_concurrency)
    timeout = httpx.Timeout(connect=30.0, read=None, write=None, pool=None)
    metrics_url = args.metrics_url or f"{args.base_url}/metrics"
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        model = args.model or await first_model(client, args.base_url)
        payloads = [build_payload(args.endpoint, model, s, args.ignore_eos) for s in samples]
        offsets = arrivals(samples, args)
        before = await scrape_metrics(client, metrics_url)
        prefill_url = args.prefill_url + args.endpoint if args.prefill_url else None
        run = run_conversations if closed_loop(args) else run_requests
        records, duration = await run(client, args.base_url + args.endpoint, payloads,
                                      samples, offsets, args.max_concurrency, prefill_url, args.label)
        after = await scrape_metrics(client, metrics_url)
    metrics = compute_metrics(records, duration, slos)
    server = server_metric_deltas(before, after) if before is not None and after is not None else None
    return {"date": datetime.now().isoformat(timespec="seconds"), "label": args.label, "model": model,
            "parameters": {k: v for k, v in vars(args).items() if k != "api_key"},
            "metrics": metrics, "server_metrics": server, "notes": _notes(metrics, server, metrics_url),
            "requests": [_record_json(r) for r in records]}


def _notes(metrics: dict, server: dict | None, metrics_url: str) -> list[str]:
    notes = []
    if metrics["output_len_from_chunks"]:
        notes.append(f"{metrics['output_len_from_chunks']} requests had no usage chunk: "
                     "their output length is the number of content chunks")
    if server is None:
        notes.append(f"no Prometheus metrics at {metrics_url}")
    return notes


def _record_json(r: RequestRecord) -> dict:
    return {"start": r.start, "ttft": r.ttft, "itl": r.itl, "e2el": r.e2el if r.success else None,
            "output_len": r.output_len, "prompt_len": r.prompt_len, "turn": r.turn, "error": r.error}


def _row(name: str, value: float | int | None, fmt: str = ".2f") -> str:
    shown = "n/a" if value is None else format(value, fmt)
    return f"{name + ':':<40}{shown:<10}"


def format_table(result: dict) -> str:
    m, p = result["metrics"], result["parameters"]
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
             _row("Successful requests", m["completed"], "d"), _row("Failed requests", m["failed"], "d"),
             _row("Maximum request concurrency", p["max_concurrency"], "d"),
             _row("Peak concurrent requests", m["peak_concurrency"], "d"),
             _row("Benchmark duration (s)", m["duration_s"]),
             _row("Total input tokens", m["total_input_tokens"], "d"),
             _row("Total generated tokens", m["total_output_tokens"], "d"),
             _row("Request throughput (req/s)", m["request_throughput"]),
             _row("Request goodput (req/s)", m["request_goodput"]),
             _row("Output token throughput (tok/s)", m["output_throughput"]),
             _row("Total token throughput (tok/s)", m["total_token_throughput"])]
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append("{s:{c}^50}".format(s=f" {title} ", c="-"))
        lines += [_row(f"{stat.capitalize()} {key.upper()} (ms)", m[f"{stat}_{key}_ms"])
                  for stat in ("mean", "median", "std", "p99")]
        if key == "ttft" and m["mean_ttft_later_turns_ms"] is not None:
            lines += [_row(f"{stat.capitalize()} TTFT, turns >= 2 (ms)", m[f"{stat}_ttft_later_turns_ms"])
                      for stat in ("mean", "median")]
    lines += _server_rows(result["server_metrics"])
    return "\n".join(lines + ["=" * 50] + result["notes"])


def _server_rows(server: dict | None) -> list[str]:
    if not server or not (server["prefix_cache"] or server["kv_transfer_bytes"]):
        return []
    lines = ["{s:{c}^50}".format(s=" Server metrics (delta) ", c="-")]
    if prefix := server["prefix_cache"]:
        lines.append(_row("Prefix cache hit rate", prefix["hit_rate"], ".3f"))
        lines += [_row(f"  group {g} hit rate", v["hit_rate"], ".3f") for g, v in prefix["by_group"].items()]
    if transfer := server["kv_transfer_bytes"]:
        lines.append(_row("KV transfer bytes", transfer["total"], ",.0f"))
    return lines


def build_parser(prog: str = "python -m benchmarks.serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog,
                                     description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    add("--endpoint", choices=ENDPOINTS, default="/v1/completions",
        help="API route (default: /v1/completions)")
    add("--model", help="model name to send (default: the first from /v1/models)")
    add("--prefill-url", help="drive PD from the client: send each request to this prefill server "
        "first (as the proxy does: unstreamed, do_remote_decode), then to BASE_URL (the decode server) with its "
        "kv_transfer_params (default: off, BASE_URL serves whole requests)")
    add("--num-prompts", type=int, default=1000, help="number of requests (default: 1000)")
    add("--request-rate", type=float, default=float("inf"),
        help="mean arrivals per second; inf sends all at once, or a trace at its own times (default: inf)")
    add("--burstiness", type=float, default=1.0,
        help="gamma shape of the arrival gaps: 1 is Poisson, <1 burstier, >1 more even (default: 1)")
    add("--max-concurrency", type=int, help="most requests in flight at once (default: no limit)")
    add("--seed", type=int, default=0, help="seed for the dataset and arrival times (default: 0)")
    add("--ignore-eos", action="store_true", help="send ignore_eos: true so every request runs to max_tokens")
    add("--goodput", nargs="+", metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (milliseconds)")
    add("--metrics-url", help="Prometheus endpoint to scrape (default: BASE_URL/metrics)")
    add("--save-result", action="store_true", help="write the result JSON (see --result-file)")
    add("--result-file", help="result JSON path; implies --save-result "
        "(default: results/serve-LABEL-DATE.json)")
    add("--label", default="pd", help="name of this run, stored in the result (default: pd)")
    add("--api-key", help="sent as 'Authorization: Bearer KEY' (never saved)")
    add_dataset_args(parser)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks.serve") -> dict:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be at least 1")
    try:
        parse_goodput(args.goodput)
        closed_loop(args)
    except ValueError as exc:
        parser.error(str(exc))
    args.base_url = args.base_url.rstrip("/")
    if args.prefill_url:
        args.prefill_url = args.prefill_url.rstrip("/")
    result = asyncio.run(benchmark(args))
    print(format_table(result))
    if args.save_result or args.result_file:
        path = Path(args.result_file or f"results/serve-{args.label}-{datetime.now():%Y%m%d-%H%M%S}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"saved {path}")
    if result["metrics"]["completed"] == 0:
        first_error = next((r["error"] for r in result["requests"] if r["error"]), None)
        print(f"every request failed; first error: {first_error}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
