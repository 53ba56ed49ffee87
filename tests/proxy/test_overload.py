"""Overload through the proxy (1P1D, small KV caches, real servers and NIXL): 200
streaming requests at once, half of them hanging up after their first chunk. Every
client that stays gets the colocated server's tokens; both engines are the same
processes afterwards, and their KV usage and held blocks return to 0.

This is the run that used to kill the decode engine ("token counts must be
non-negative": a preempted remote-prefill request asked to re-read P's blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time

import httpx
import pytest

from launch import http_client
from tests.support.server_harness import running_proxy, running_server

pytestmark = pytest.mark.slow
MODEL = "qwen3"
NUM_REQUESTS = 200
NUM_DISCONNECTING = 100
KEEP_TOKENS = 16  # every staying request crosses a block boundary: growth that must preempt
MAX_RETRIES = 50  # a prefill server past its held-blocks share answers 503 + Retry-After
PROMPTS = [f"Story {i}: " + " ".join(["the keeper watched the sea and wrote"] * (1 + i % 6)) for i in range(20)]


@pytest.fixture(scope="module")
def deployment(tiny_models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("overload")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    model = tiny_models[MODEL]
    common = ("--max-model-len", "256", "--log-level", "warning", "--reserve-growth-tokens", "0")  # preempting
    with contextlib.ExitStack() as stack:
        start = lambda name, *args: stack.enter_context(  # noqa: E731
            running_server(model, logs / f"{name}.log", *common, *args))
        servers = {"p": start("p", "--role", "prefill", "--kv-cache-memory", str(8 << 20)),
                   "d": start("d", "--role", "decode", "--kv-cache-memory", str(2 << 20)),  # 31 blocks
                   "c": start("c")}
        proxy = stack.enter_context(running_proxy(logs / "proxy.log", "--prefill", servers["p"].url,
                                                  "--decode", servers["d"].url, "--log-level", "warning"))
        yield servers | {"proxy": proxy}


def reference_texts(server) -> dict[str, str]:
    out = {}
    for prompt in PROMPTS:
        response = http_client().post(f"{server.url}/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": KEEP_TOKENS, "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        out[prompt] = response.json()["choices"][0]["text"]
    return out


async def stream_once(client: httpx.AsyncClient, url: str, prompt: str, leave_early: bool) -> tuple[int, str, dict]:
    """(status, text, headers); a leaving client returns after the first data chunk."""
    body = {"prompt": prompt, "max_tokens": 64 if leave_early else KEEP_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            return response.status_code, (await response.aread()).decode(), dict(response.headers)
        text = ""
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            text += "".join(choice["text"] for choice in event["choices"])
            if leave_early:
                return 200, text, {}
        return 200, text, {}


async def one_client(client: httpx.AsyncClient, url: str, prompt: str, leave_early: bool) -> str | None:
    """The text a staying client got (None for one that left); retries a 503 that says when."""
    for _ in range(MAX_RETRIES):
        status, text, headers = await stream_once(client, url, prompt, leave_early)
        if status == 503 and "retry-after" in headers:
            await asyncio.sleep(float(headers["retry-after"]))
            continue
        assert status == 200, (status, text)
        return None if leave_early else text
    pytest.fail(f"still refused after {MAX_RETRIES} tries")


async def run_load(url: str, seed: int) -> list[tuple[str, str | None]]:
    rng = random.Random(seed)
    plan = [(rng.choice(PROMPTS), i < NUM_DISCONNECTING) for i in range(NUM_REQUESTS)]
    rng.shuffle(plan)
    limits = httpx.Limits(max_connections=NUM_REQUESTS + 10)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        texts = await asyncio.gather(*(one_client(client, url, p, leave) for p, leave in plan))
    return [(p, t) for (p, _), t in zip(plan, texts)]


def engine_pid(server) -> int:
    health = server.health()
    assert health.status_code == 200, health.text
    return health.json()["engine_pid"]


def wait_drained(server, timeout: float = 90.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        drained = metrics["pd_kv_cache_usage"] == 0 and metrics.get("pd_kv_requests_held", 0) == 0 \
            and metrics["pd_num_requests_running"] == 0 and metrics["pd_num_requests_waiting"] == 0
        if drained or time.monotonic() > deadline:
            return metrics
        time.sleep(0.2)


def test_overload_with_half_the_clients_leaving_loses_nothing_and_kills_nothing(deployment) -> None:
    p, d = deployment["p"], deployment["d"]
    pids = engine_pid(p), engine_pid(d)
    reference = reference_texts(deployment["c"])
    results = asyncio.run(run_load(deployment["proxy"].url, seed=int(os.environ.get("PD_OVERLOAD_SEED", "0"))))
    stayed = [(prompt, text) for prompt, text in results if text is not None]
    assert len(stayed) == NUM_REQUESTS - NUM_DISCONNECTING
    wrong = [prompt for prompt, text in stayed if text != reference[prompt]]
    assert not wrong, f"{len(wrong)} staying clients got other tokens than the colocated server"
    assert (engine_pid(p), engine_pid(d)) == pids
    for server in (p, d):
        metrics = wait_drained(server)
        assert metrics["pd_kv_cache_usage"] == 0 and metrics["pd_kv_requests_held"] == 0, metrics
        assert metrics["pd_num_requests_running"] == 0 and metrics["pd_num_requests_waiting"] == 0
    assert d.metrics()["pd_num_preemptions_total"] > 0  # the small cache did preempt


def test_a_burst_past_what_the_caches_hold_completes_for_every_staying_client_without_preemption(
        tiny_models, tmp_path) -> None:
    """Issue 31 row 7: a burst of streams through 1P1D on 4 MiB caches (a request's KV
    is most of D's cache), half leaving after their first chunk. P's held-blocks cap
    answered 77 of 80 with 503, or, without it, D's cache thrashed. Now P's refusals are
    back-pressure to the proxy's queue, and D admits a request when it can grow to its
    end: every staying client gets every token, with no preemption and nothing refused."""
    small = ("--kv-cache-memory", str(4 << 20), "--max-model-len", "512", "--log-level", "warning")
    with contextlib.ExitStack() as stack:
        p = stack.enter_context(running_server(tiny_models[MODEL], tmp_path / "p.log", "--role", "prefill", *small))
        d = stack.enter_context(running_server(tiny_models[MODEL], tmp_path / "d.log", "--role", "decode", *small))
        proxy = stack.enter_context(running_proxy(tmp_path / "proxy.log", "--prefill", p.url, "--decode", d.url,
                                                  "--log-level", "warning"))
        pids = engine_pid(p), engine_pid(d)
        prompts = [[10 + (7 * k + j) % 3000 for j in range(240)] for k in range(24)]  # 15 blocks each

        async def one(client: httpx.AsyncClient, k: int) -> tuple[int, int]:
            body = {"prompt": prompts[k], "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with client.stream("POST", f"{proxy.url}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    return response.status_code, 0
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[len("data: "):])
                        assert "error" not in event, event
                        if k % 2:  # leaves after its first chunk
                            return 200, -1
                        if event.get("usage") and not event.get("choices"):
                            return 200, event["usage"]["completion_tokens"]
            return 200, 0

        async def burst():
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
                return await asyncio.gather(*(one(client, k) for k in range(len(prompts))))

        results = asyncio.run(burst())
        assert all(status == 200 for status, _ in results), results
        assert [tokens for k, (_, tokens) in enumerate(results) if k % 2 == 0] == [48] * 12
        assert (engine_pid(p), engine_pid(d)) == pids
        assert d.metrics()["pd_num_preemptions_total"] == 0
        for server in (p, d):
            metrics = wait_drained(server)
            assert metrics["pd_kv_cache_usage"] == 0 and metrics["pd_kv_requests_held"] == 0, metrics

