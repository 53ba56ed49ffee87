"""64 concurrent streaming requests on a KV cache too small to hold them all: requests are
preempted and resumed, and every one still streams exactly its unbatched greedy output."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from pd.contracts.sampling_params import SamplingParams
from pd.llm import LLM
from tests.support.server_harness import running_server

pytestmark = pytest.mark.slow

NUM_REQUESTS = 64
MAX_TOKENS = 24
SMALL_KV_CACHE = 1 << 20  # qwen3 tiny: 64 KiB a block of 16 tokens -> 16 blocks, ~4 requests' worth


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10, 4000) for _ in range(rng.randrange(4, 40))] for _ in range(NUM_REQUESTS)]


async def stream_one(client: httpx.AsyncClient, prompt: list[int]) -> tuple[str, str | None]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, "ignore_eos": True}
    text, reason = "", None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
            reason = chunk["choices"][0]["finish_reason"] or reason
    return text, reason


async def stream_all(url: str, all_prompts: list[list[int]]) -> list[tuple[str, str | None]]:
    limits = httpx.Limits(max_connections=NUM_REQUESTS)
    async with httpx.AsyncClient(base_url=url, timeout=180, limits=limits) as client:
        return await asyncio.gather(*(stream_one(client, p) for p in all_prompts))


def test_concurrent_streams_with_preemption_equal_unbatched_greedy(tiny_models, tmp_path) -> None:
    all_prompts = prompts()
    # A roomy batch: every request runs from start to end, never preempted.
    llm = LLM(str(tiny_models["qwen3"]), kv_cache_memory=32 << 20)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    expected = [out.text for out in llm.generate(all_prompts, params)]
    del llm
    with running_server(tiny_models["qwen3"], tmp_path / "server.log", "--max-model-len", "128",
                        "--kv-cache-memory", str(SMALL_KV_CACHE), "--reserve-growth-tokens", "0") as server:
        results = asyncio.run(stream_all(server.url, all_prompts))
        metrics = server.metrics()
        mismatches = [i for i, (text, _) in enumerate(results) if text != expected[i]]
        assert not mismatches, f"{len(mismatches)} outputs differ, e.g. #{mismatches[0]}"
        assert all(reason == "length" for _, reason in results)
        assert metrics["pd_num_preemptions_total"] > 0, "the KV cache was large enough: no preemption tested"
        assert metrics['pd_request_success_total{finish_reason="length"}'] == NUM_REQUESTS
        assert metrics["pd_generation_tokens_total"] == NUM_REQUESTS * MAX_TOKENS
        assert metrics["pd_prompt_tokens_total"] == sum(map(len, all_prompts))
        assert metrics["pd_time_to_first_token_seconds_count"] == NUM_REQUESTS
        assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0


def test_a_request_of_128_long_sequences_does_not_starve_short_ones(tiny_models, tmp_path) -> None:
    """Issue 31 row 4: while one `n: 128, best_of: 128, max_tokens: 4000` request ran,
    every 4-token request timed out (6 of 6 at 120 s). The batch is now shared fairly:
    20 short requests, one after another, all end while the big one still runs; a
    request past --max-request-tokens is refused, naming the limit."""
    import threading

    from launch import http_client

    limit = ("--max-request-tokens", "520000")  # 128 x (a short prompt + 4000) fits, 128 x its 4096 context not
    with running_server(tiny_models["qwen3"], tmp_path / "server.log", *limit) as server:
        big = {"prompt": "Tell me everything.", "n": 128, "best_of": 128, "max_tokens": 4000, "ignore_eos": True}
        too_big = http_client().post(f"{server.url}/v1/completions", json=big | {"max_tokens": None}, timeout=60)
        assert too_big.status_code == 400 and "--max-request-tokens" in too_big.json()["error"]["message"]
        done = threading.Event()
        hog = threading.Thread(target=lambda: (http_client().post(f"{server.url}/v1/completions", json=big,
                                                                  timeout=600), done.set()), daemon=True)
        hog.start()
        assert server.wait_for_metric("pd_num_requests_running", lambda v: v >= 64) >= 64  # it fills the batch
        small = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        for _ in range(20):
            response = http_client().post(f"{server.url}/v1/completions", json=small, timeout=60)
            assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
        assert not done.is_set()  # the big one still runs: the short ones did not wait for it
