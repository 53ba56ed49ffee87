import asyncio
import json
import math
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from benchmarks.datasets import (
    LOW_TOKEN_ID,
    SampleRequest,
    ids_to_text,
    multi_turn_dataset,
    prefix_repetition_dataset,
    random_dataset,
    sharegpt_dataset,
)
from benchmarks.serve import build_payload, main, parse_goodput, run_conversations
from benchmarks.serve_metrics import (
    RequestRecord,
    arrival_intervals,
    compute_metrics,
    parse_prometheus,
    peak_concurrency,
    send_offsets,
    server_metric_deltas,
)


def record(start: float, ttft: float, itl: list[float], output_len: int, prompt_len: int = 10,
           ok: bool = True) -> RequestRecord:
    end = start + ttft + sum(itl)
    return RequestRecord(prompt_len=prompt_len, start=start, end=end, success=ok, ttft=ttft, itl=itl,
                         output_len=output_len, output_len_from_usage=True, error=None if ok else "boom")


# ---------------------------------------------------------------- metrics


def trace() -> list[RequestRecord]:
    return [
        record(0.0, 0.1, [0.02, 0.04], 3, prompt_len=10),   # e2el 0.16, tpot 0.03
        record(0.05, 0.2, [0.06], 2, prompt_len=20),        # e2el 0.26, tpot 0.06
        record(0.1, 0.3, [], 1, prompt_len=30),             # e2el 0.30, no tpot
        record(0.2, 5.0, [1.0], 2, prompt_len=1000, ok=False),  # failed: only in counts/peak
    ]


def test_compute_metrics_matches_hand_computed_trace() -> None:
    m = compute_metrics(trace(), duration=2.0)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 6)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(33.0)
    assert m["request_goodput"] is None
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["std_ttft_ms"] == pytest.approx(np.std([100, 200, 300]))
    assert m["p99_ttft_ms"] == pytest.approx(200 + 0.98 * 100)  # linear interpolation
    # TPOT only over the two requests with more than one output token.
    assert m["mean_tpot_ms"] == pytest.approx(45.0)
    assert m["median_tpot_ms"] == pytest.approx(45.0)
    assert m["p99_tpot_ms"] == pytest.approx(30 + 0.99 * 30)
    # ITL over all gaps [20, 40, 60].
    assert m["mean_itl_ms"] == pytest.approx(40.0)
    assert m["median_itl_ms"] == pytest.approx(40.0)
    assert m["p99_itl_ms"] == pytest.approx(40 + 0.98 * 20)
    assert m["mean_ttft_later_turns_ms"] is None  # no multi-turn requests


def test_later_turns_have_their_own_ttft() -> None:
    """A conversation's turns after the first, apart: what the earlier turns left cached
    shows there (the first turns' TTFT dilutes it in the overall mean)."""
    records = trace()
    records[1].turn, records[2].turn, records[3].turn = 1, 3, 2  # the failed one is left out as everywhere
    m = compute_metrics(records, duration=2.0)
    assert m["mean_ttft_later_turns_ms"] == pytest.approx(250.0) and m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_later_turns_ms"] == pytest.approx(250.0)
    assert m["mean_e2el_ms"] == pytest.approx((160 + 260 + 300) / 3)
    assert m["median_e2el_ms"] == pytest.approx(260.0)
    assert m["p99_e2el_ms"] == pytest.approx(260 + 0.98 * 40)
    # Spans [0,.16] [.05,.31] [.1,.4] [.2,6.2]: three overlap at t=0.1 and again at t=0.2.
    assert m["peak_concurrency"] == 3
    assert m["duration_s"] == 2.0


def test_goodput_counts_requests_meeting_every_slo() -> None:
    records = trace()
    # ttft <= 250 ms keeps requests 1, 2; tpot <= 50 ms drops request 2 (60 ms).
    assert compute_metrics(records, 2.0, {"ttft": 250, "tpot": 50})["request_goodput"] == pytest.approx(0.5)
    # A one-token output has TPOT 0, so it passes any TPOT SLO.
    assert compute_metrics(records, 2.0, {"tpot": 1})["request_goodput"] == pytest.approx(0.5)
    assert compute_metrics(records, 2.0, {"e2el": 1000})["request_goodput"] == pytest.approx(1.5)
    assert compute_metrics(records, 2.0, {"e2el": 100})["request_goodput"] == 0


def test_metrics_without_successes_are_absent_not_nan() -> None:
    m = compute_metrics([record(0, 0.1, [], 1, ok=False)], duration=1.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["mean_ttft_ms"] is None and m["p99_itl_ms"] is None
    assert m["request_throughput"] == 0


def test_peak_concurrency_from_start_and_end_times() -> None:
    def span(start: float, end: float) -> RequestRecord:
        return RequestRecord(prompt_len=1, start=start, end=end)

    assert peak_concurrency([]) == 0
    assert peak_concurrency([span(0, 1), span(1, 2), span(2, 3)]) == 1  # back to back
    assert peak_concurrency([span(0, 10), span(1, 2), span(1.5, 3), span(2.5, 4)]) == 3
    assert peak_concurrency([span(0, 1)] * 5) == 5


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    assert parse_goodput(None) == {}
    for bad in (["ttft"], ["latency:3"], ["e2el:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


# ---------------------------------------------------------------- arrivals


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_gamma_arrivals_have_mean_interval_one_over_rate(burstiness: float) -> None:
    gaps = np.array(arrival_intervals(20000, rate=5.0, burstiness=burstiness, seed=1))
    assert (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)
    # gamma variance = shape * scale^2 = mean^2 / burstiness: burstier means more spread.
    assert gaps.var() == pytest.approx(0.04 / burstiness, rel=0.15)


def test_arrivals_are_seeded_and_inf_is_all_at_once() -> None:
    assert arrival_intervals(50, 2.0, 1.0, seed=3) == arrival_intervals(50, 2.0, 1.0, seed=3)
    assert arrival_intervals(50, 2.0, 1.0, seed=3) != arrival_intervals(50, 2.0, 1.0, seed=4)
    assert arrival_intervals(7, float("inf"), 1.0, seed=0) == [0.0] * 7
    assert send_offsets([0.5, 1.0, 2.0]) == [0.0, 0.5, 1.5]
    assert send_offsets([]) == []


# ---------------------------------------------------------------- datasets


def test_random_dataset_exact_lengths_shared_prefix_and_seed() -> None:
    samples = random_dataset(20, input_len=50, output_len=7, prefix_len=16, vocab_size=300, seed=5)
    assert len(samples) == 20
    for s in samples:
        assert len(s.prompt) == s.prompt_len == 50 and s.output_len == 7
        assert all(LOW_TOKEN_ID <= t < 300 for t in s.prompt)
        assert s.prompt[:16] == samples[0].prompt[:16]
    assert len({tuple(s.prompt[16:]) for s in samples}) == 20
    assert samples == random_dataset(20, 50, 7, 16, 300, seed=5)
    assert samples != random_dataset(20, 50, 7, 16, 300, seed=6)
    with pytest.raises(ValueError):
        random_dataset(1, input_len=4, output_len=1, prefix_len=5, vocab_size=300, seed=0)


def test_prefix_repetition_dataset_groups_prompts_by_prefix() -> None:
    samples = prefix_repetition_dataset(12, prefix_len=8, suffix_len=5, num_prefixes=3, output_len=4,
                                        vocab_size=1000, seed=2)
    assert all(len(s.prompt) == s.prompt_len == 13 and s.output_len == 4 for s in samples)
    by_prefix: dict[tuple, int] = {}
    for s in samples:
        by_prefix[tuple(s.prompt[:8])] = by_prefix.get(tuple(s.prompt[:8]), 0) + 1
    assert sorted(by_prefix.values()) == [4, 4, 4]
    assert len({tuple(s.prompt) for s in samples}) == 12
    assert samples == prefix_repetition_dataset(12, 8, 5, 3, 4, 1000, seed=2)
    # Shuffled: the first three prompts are not simply one of each prefix in creation order
    # for every seed (groups interleave rather than arrive in blocks).
    orders = {tuple(tuple(s.prompt[:8]) for s in prefix_repetition_dataset(12, 8, 5, 3, 4, 1000, seed=k))
              for k in range(5)}
    assert len(orders) > 1


def conversation(samples: list[SampleRequest], prompt: list[int]) -> int:
    """Which of the first turns `prompt` extends."""
    return next(i for i, s in enumerate(samples[:4]) if prompt[:len(s.prompt)] == s.prompt)


def test_multi_turn_dataset_extends_each_conversation_turn_by_turn() -> None:
    samples = multi_turn_dataset(13, turns=3, system_len=10, user_len=4, answer_len=2, output_len=5,
                                 vocab_size=1000, seed=3)
    assert len(samples) == 12  # 4 conversations of 3 turns: turn 1 of each, then turn 2 of each...
    system = samples[0].prompt[:10]
    assert all(s.prompt[:10] == system and len(s.prompt) == s.prompt_len and s.output_len == 5 for s in samples)
    for turn in range(3):
        assert [len(s.prompt) for s in samples[4 * turn:4 * turn + 4]] == [10 + 4 + 6 * turn] * 4
        assert [s.turn for s in samples[4 * turn:4 * turn + 4]] == [turn] * 4
        assert all(s.prompt[-4:] == s.message for s in samples[4 * turn:4 * turn + 4])
    by_turn = {(s.conversation, s.turn): s for s in samples}
    assert len(by_turn) == 12 and {s.conversation for s in samples} == {0, 1, 2, 3}
    for s in samples[4:]:  # a turn extends its conversation's last turn
        assert s.prompt[:len(by_turn[s.conversation, s.turn - 1].prompt)] == by_turn[s.conversation, s.turn - 1].prompt
    second = {conversation(samples, s.prompt): s.prompt for s in samples[4:8]}
    assert sorted(second) == [0, 1, 2, 3]  # turn 2 of each conversation, then turn 3 of each
    assert sorted(conversation(samples, s.prompt) for s in samples[8:]) == [0, 1, 2, 3]
    assert all(s.prompt[:len(second[conversation(samples, s.prompt)])] == second[conversation(samples, s.prompt)]
               for s in samples[8:])
    orders = set()
    for seed in range(6):
        more = multi_turn_dataset(8, 2, 10, 4, 2, 5, 1000, seed=seed)
        orders.add(tuple(conversation(more, s.prompt) for s in more[4:]))
    assert len(orders) > 1  # each turn's conversations come in a random order
    assert len({tuple(s.prompt[:14]) for s in samples[:4]}) == 4  # they differ after the system prompt
    assert samples == multi_turn_dataset(13, 3, 10, 4, 2, 5, 1000, seed=3)
    with pytest.raises(ValueError):
        multi_turn_dataset(2, turns=3, system_len=1, user_len=1, answer_len=1, output_len=1, vocab_size=100, seed=0)


def test_sharegpt_dataset_estimates_lengths(tmp_path: Path) -> None:
    convs = [{"conversations": [{"from": "human", "value": "q" * (40 + i)},
                                {"from": "gpt", "value": "a" * 80}]} for i in range(10)]
    convs.append({"conversations": [{"from": "human", "value": "only one turn"}]})
    convs.append({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "a" * 80}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    samples = sharegpt_dataset(path, num_prompts=10, seed=0)
    assert sorted(len(s.prompt) for s in samples) == [40 + i for i in range(10)]  # short/one-turn dropped
    for s in samples:
        assert s.prompt_len == round(len(s.prompt) / 4) and s.output_len == 20
    assert [s.prompt for s in samples] == [s.prompt for s in sharegpt_dataset(path, 10, seed=0)]
    assert sharegpt_dataset(path, 3, seed=0, output_len=9)[0].output_len == 9
    with pytest.raises(ValueError):
        sharegpt_dataset(path, num_prompts=11, seed=0)


def test_ids_to_text_is_deterministic_and_injective() -> None:
    words = ids_to_text(list(range(5000))).split(" ")
    assert len(words) == len(set(words)) == 5000
    assert ids_to_text([1, 2, 3]) == ids_to_text([1, 2, 3])
    sample = SampleRequest([100, 200], 2, 1)
    chat = build_payload("/v1/chat/completions", "m", sample, ignore_eos=True)
    assert chat["messages"] == [{"role": "user", "content": ids_to_text([100, 200])}]
    assert chat["ignore_eos"] is True and chat["stream_options"] == {"include_usage": True}
    completion = build_payload("/v1/completions", "m", sample, ignore_eos=False)
    assert completion["prompt"] == [100, 200] and "ignore_eos" not in completion


# ---------------------------------------------------------------- Prometheus


METRICS_BEFORE = """\
# HELP pd_prefix_cache_queries_total Tokens looked up in the prefix cache.
# TYPE pd_prefix_cache_queries_total counter
pd_prefix_cache_queries_total{group="0",model="m"} 100.0
pd_prefix_cache_queries_total{group="1",model="m"} 50.0
pd_prefix_cache_hits_total{group="0",model="m"} 10.0
pd_prefix_cache_hits_total{group="1",model="m"} 0.0
pd_prefix_cache_queries_created{group="0",model="m"} 1.7e9
other_metric{path="/a\\"b}"} 3 1700000000000
"""
METRICS_AFTER = """\
pd_prefix_cache_queries_total{group="0",model="m"} 300.0
pd_prefix_cache_queries_total{group="1",model="m"} 150.0
pd_prefix_cache_hits_total{group="0",model="m"} 160.0
pd_prefix_cache_hits_total{group="1",model="m"} 25.0
pd_kv_transfer_bytes_total{direction="send"} 4096
"""


def test_parse_prometheus_labelled_counters() -> None:
    samples = parse_prometheus(METRICS_BEFORE)
    assert samples["pd_prefix_cache_queries_total"] == {
        (("group", "0"), ("model", "m")): 100.0, (("group", "1"), ("model", "m")): 50.0}
    assert samples["other_metric"] == {(("path", '/a"b}'),): 3.0}  # escaped quote, timestamp dropped
    assert parse_prometheus("up 1\n")["up"] == {(): 1.0}


def test_server_metric_deltas_hit_rates_overall_and_per_group() -> None:
    deltas = server_metric_deltas(parse_prometheus(METRICS_BEFORE), parse_prometheus(METRICS_AFTER))
    prefix = deltas["prefix_cache"]
    assert (prefix["queries"], prefix["hits"]) == (300.0, 175.0)
    assert prefix["hit_rate"] == pytest.approx(175 / 300)
    assert prefix["by_group"]["0"] == {"queries": 200.0, "hits": 150.0, "hit_rate": 0.75}
    assert prefix["by_group"]["1"]["hit_rate"] == pytest.approx(0.25)
    assert deltas["kv_transfer_bytes"]["total"] == 4096
    assert server_metric_deltas({}, {}) == {"prefix_cache": None, "kv_transfer_bytes": None, "tier_hits": None}


def test_server_metric_deltas_take_pd_serves_overall_series_as_the_overall_rate() -> None:
    # pd serve: an unlabelled overall series (after the reduction) beside per-group ones
    before = parse_prometheus("pd_prefix_cache_queries_total 0\npd_prefix_cache_hits_total 0\n")
    after = parse_prometheus("""\
pd_prefix_cache_queries_total 100
pd_prefix_cache_queries_total{group="0:full_attention"} 100
pd_prefix_cache_queries_total{group="1:mamba"} 100
pd_prefix_cache_hits_total 0
pd_prefix_cache_hits_total{group="0:full_attention"} 80
pd_prefix_cache_hits_total{group="1:mamba"} 0
""")
    prefix = server_metric_deltas(before, after)["prefix_cache"]
    assert (prefix["queries"], prefix["hits"]) == (100.0, 0.0)  # the collapsed hit, not 80 of 300
    assert prefix["by_group"]["0:full_attention"]["hit_rate"] == 0.8


# ---------------------------------------------------------------- live HTTP


def streaming_app(chunk_sleep: float) -> FastAPI:
    """A minimal OpenAI-compatible streaming server: one chunk per token, then usage."""
    app = FastAPI()
    counters = {"queries": 0, "hits": 0}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "tiny", "object": "model"}]}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> str:
        return (f'pd_prefix_cache_queries_total{{group="0"}} {counters["queries"]}\n'
                f'pd_prefix_cache_hits_total{{group="0"}} {counters["hits"]}\n')

    async def stream(body: dict, chat: bool):
        prompt_len = len(body["prompt"]) if not chat else len(body["messages"][0]["content"].split())
        counters["queries"] += prompt_len
        counters["hits"] += prompt_len // 2
        n = body["max_tokens"]
        if chat:
            yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant'}}]})}\n\n"
        for i in range(n):
            await asyncio.sleep(chunk_sleep)
            choice = {"index": 0, "delta": {"content": f" t{i}"}} if chat else {"index": 0, "text": f" t{i}"}
            yield f"data: {json.dumps({'choices': [choice]})}\n\n"
        usage = {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        return StreamingResponse(stream(await request.json(), chat=False), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        return StreamingResponse(stream(await request.json(), chat=True), media_type="text/event-stream")

    return app


@pytest.fixture
def server_url():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(streaming_app(chunk_sleep=0.005), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "test server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def assert_finite_non_negative(metrics: dict) -> None:
    for key, value in metrics.items():
        if value is not None:
            assert math.isfinite(value) and value >= 0, (key, value)


def test_live_benchmark_against_streaming_server(server_url: str, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    main(["--base-url", server_url, "--num-prompts", "8", "--max-concurrency", "2",
          "--random-input-len", "12", "--random-output-len", "6", "--random-prefix-len", "4",
          "--request-rate", "200", "--goodput", "ttft:10000", "tpot:10000", "--ignore-eos",
          "--result-file", str(out), "--label", "live"])
    result = json.loads(out.read_text())
    assert set(result) == {"date", "label", "model", "parameters", "metrics", "server_metrics",
                           "notes", "requests"}
    assert result["model"] == "tiny" and result["label"] == "live" and result["notes"] == []
    assert result["parameters"]["max_concurrency"] == 2 and "api_key" not in result["parameters"]
    m = result["metrics"]
    assert_finite_non_negative(m)
    assert (m["completed"], m["failed"]) == (8, 0)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (8 * 12, 8 * 6)
    assert m["request_throughput"] > 0 and m["output_throughput"] > 0
    assert m["total_token_throughput"] == pytest.approx(m["output_throughput"] * 3)
    assert m["request_goodput"] == pytest.approx(m["request_throughput"])
    assert 1 <= m["peak_concurrency"] <= 2
    assert m["output_len_from_chunks"] == 0
    for key in ("ttft", "tpot", "itl", "e2el"):
        assert m[f"mean_{key}_ms"] > 0 and m[f"p99_{key}_ms"] >= m[f"median_{key}_ms"] > 0
    assert m["mean_e2el_ms"] > m["mean_ttft_ms"]
    assert result["server_metrics"]["prefix_cache"]["queries"] == 8 * 12
    assert result["server_metrics"]["prefix_cache"]["by_group"]["0"]["hit_rate"] == pytest.approx(0.5)
    assert len(result["requests"]) == 8
    for r in result["requests"]:
        assert r["error"] is None and (r["output_len"], r["prompt_len"]) == (6, 12)
        assert len(r["itl"]) == r["output_len"] - 1 and all(gap >= 0 for gap in r["itl"])
        assert 0 < r["ttft"] <= r["e2el"] and r["start"] >= 0
        assert r["ttft"] + sum(r["itl"]) <= r["e2el"] + 1e-9


def test_live_multi_turn_run_reports_the_later_turns_apart(server_url: str, capsys) -> None:
    result = main(["--base-url", server_url, "--num-prompts", "6", "--dataset", "multi-turn", "--multi-turn-turns", "3",
                   "--multi-turn-system-len", "4", "--multi-turn-user-len", "3", "--multi-turn-answer-len", "2",
                   "--multi-turn-output-len", "3", "--ignore-eos"])
    assert [r["turn"] for r in result["requests"]] == [0, 0, 1, 1, 2, 2]
    m = result["metrics"]
    assert m["mean_ttft_later_turns_ms"] > 0 and m["mean_ttft_ms"] > 0
    assert "Mean TTFT, turns >= 2 (ms)" in capsys.readouterr().out


@pytest.mark.parametrize("returns_ids", [True, False])
def test_closed_loop_turns_carry_the_models_answers(returns_ids: bool) -> None:
    """Closed loop: a conversation's next turn is sent after its last was answered, its
    prompt the last one, the answer's token ids (the dataset's stand-in where the server
    returned none) and the new message."""
    samples = multi_turn_dataset(6, turns=3, system_len=4, user_len=2, answer_len=3, output_len=2,
                                 vocab_size=1000, seed=1)
    sent = []

    def answer(request):
        body = json.loads(request.content)
        sent.append(body["prompt"])
        assert body["return_token_ids"] is True
        chunks = [{"choices": [{"index": 0, "text": f" t{i}", **({"token_ids": [t]} if returns_ids else {})}]}
                  for i, t in enumerate([len(body["prompt"]), 7])]  # an answer that depends on the prompt
        chunks.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 2}})
        return httpx.Response(200, content="".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n")

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            payloads = [build_payload("/v1/completions", "m", s, True) for s in samples]
            return await run_conversations(client, "http://127.0.0.1:1/v1/completions", payloads, samples,
                                           [0.0] * len(samples), 2)

    records, _ = asyncio.run(run())
    assert all(r.success for r in records) and [r.turn for r in records] == [s.turn for s in samples]
    for c in range(2):
        turns = [(s, r) for s, r in zip(samples, records) if s.conversation == c]
        prompt = turns[0][0].prompt
        for k, (sample, record) in enumerate(turns):
            if k:
                last = turns[k - 1][0]
                got = [len(prompt), 7] if returns_ids else sample.prompt[len(last.prompt):-2]
                prompt = prompt + got + sample.message
            assert prompt in sent and record.prompt_len == len(prompt), (c, k)
            assert record.token_ids == ([len(prompt), 7] if returns_ids else [])
    assert len(sent) == 6


def test_live_chat_endpoint_skips_role_chunk(server_url: str) -> None:
    result = main(["--base-url", server_url, "--endpoint", "/v1/chat/completions", "--num-prompts", "3",
                   "--random-input-len", "5", "--random-output-len", "4"])
    assert result["metrics"]["completed"] == 3
    for r in result["requests"]:
        assert r["output_len"] == 4 and r["prompt_len"] == 5 and len(r["itl"]) == 3


def test_live_failures_are_recorded_not_raised(server_url: str) -> None:
    result = main(["--base-url", server_url + "/nowhere", "--model", "tiny", "--num-prompts", "2",
                   "--random-input-len", "4", "--random-output-len", "2"])
    m = result["metrics"]
    assert (m["completed"], m["failed"]) == (0, 2)
    assert all(r["error"].startswith("HTTP 404") for r in result["requests"])
    assert result["server_metrics"] is None
