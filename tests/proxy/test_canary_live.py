"""`pd proxy --canary-fraction 1` in front of real 1P1D servers: every greedy or seeded PD
request is run again alone on another server once its answer is sent, and the two compared.

- Every family: PD answers what a server alone does (no mismatch), and the client gets
  token ids only if it asked for them.
- A deliberately broken decode server (`PD_TEST_PERTURB_LANDED_KV=1`: the first block of
  every read garbled after the checks) is caught within the first 20 requests: counted,
  logged with both request ids, marked on the request's trace."""

from __future__ import annotations

import contextlib
import os
import random

import pytest

from launch import http_client
from tests.support.otlp import otlp_receiver
from tests.support.proxy_fakes import proxy_metric
from tests.support.server_harness import Starter, running_proxy, running_server, started_together, wait_until

pytestmark = pytest.mark.slow
REQUESTS = 20


def canaries(front, result: str) -> float:
    return proxy_metric(front.url, f'pd_proxy_canary_total{{result="{result}"}}')


def send(front, k: int, rng: random.Random) -> dict:
    """Request k: completions or chat, streamed or not, greedy or seeded, token ids asked or not."""
    chat = k % 4 == 3
    body = {"max_tokens": 8, "ignore_eos": True, **({"temperature": 0} if k % 3 else {"temperature": 0.8, "seed": k})}
    if chat:
        body["messages"] = [{"role": "user",
                             "content": f"Question {k}: " + " ".join(str(rng.randrange(99)) for _ in range(30))}]
    else:
        body["prompt"] = [rng.randrange(300, 3000) for _ in range(40 + 7 * k)]
    if k % 5 == 0:
        body["return_token_ids"] = True
    endpoint = "chat/completions" if chat else "completions"
    if k % 2:
        with http_client().stream("POST", f"{front.url}/v1/{endpoint}", json=body | {"stream": True},
                                  headers={"X-Request-Id": f"canaried-{k}"}, timeout=120) as response:
            assert response.status_code == 200
            text = response.read().decode()
        assert ("token_ids" in text) == bool(body.get("return_token_ids")), text[:300]
        return body
    response = http_client().post(f"{front.url}/v1/{endpoint}", json=body, headers={"X-Request-Id": f"canaried-{k}"},
                                  timeout=120)
    assert response.status_code == 200, response.text
    assert ("token_ids" in response.json()["choices"][0]) == bool(body.get("return_token_ids"))
    return body


@pytest.fixture(scope="module", params=["qwen3", "gemma3", "bamba", "granitehybrid"])
def deployment(request, tiny_models, tmp_path_factory):
    logs = tmp_path_factory.mktemp(f"canary-{request.param}")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with contextlib.ExitStack() as stack:
        start = Starter(tiny_models[request.param], logs, stack)
        p, d = start.all(("p", "--role", "prefill"), ("d", "--role", "decode"))
        front = stack.enter_context(running_proxy(logs / "proxy.log", "--prefill", p.url, "--decode", d.url,
                                                  "--canary-fraction", "1", "--canary-max-inflight", "64"))
        yield request.param, front


def test_pd_answers_what_one_server_alone_does(deployment) -> None:
    arch, front = deployment
    rng = random.Random(arch)
    for k in range(REQUESTS):
        send(front, k, rng)
    assert wait_until(lambda: sum(canaries(front, r) for r in ("match", "tie", "mismatch", "error")) == REQUESTS, 120)
    assert canaries(front, "mismatch") == 0 and canaries(front, "error") == 0 and canaries(front, "skipped") == 0
    assert canaries(front, "match") + canaries(front, "tie") == REQUESTS


def test_a_broken_decode_server_is_caught_within_twenty_requests(tiny_models, tmp_path) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with otlp_receiver() as (endpoint, spans), contextlib.ExitStack() as stack:
        model = tiny_models["qwen3"]
        p = stack.enter_context(running_server(model, tmp_path / "p.log", "--role", "prefill", wait=False))
        d = stack.enter_context(running_server(model, tmp_path / "d.log", "--role", "decode", wait=False,
                                               env={"PD_TEST_PERTURB_LANDED_KV": "1"}))
        alone = stack.enter_context(running_server(model, tmp_path / "alone.log", "--role", "decode", wait=False))
        started_together(stack, p, d, alone)
        front = stack.enter_context(running_proxy(
            tmp_path / "proxy.log", "--prefill", p.url, "--decode", d.url, alone.url, "--decode-policy",
            "round_robin", "--canary-fraction", "1", "--otlp-traces-endpoint", endpoint))
        rng = random.Random(5)
        for k in range(REQUESTS):
            send(front, 2 * k, rng)  # unstreamed ones; on D or on the good server in turn
            if canaries(front, "mismatch"):
                break
        assert wait_until(lambda: canaries(front, "mismatch") >= 1, 60), k
        log = front.log_tail(20000)
        assert "canary mismatch: request canaried-" in log and "-canary (alone on" in log
        assert wait_until(lambda: any(s.name == "proxy.canary" and s.attributes.get("pd.canary.result") == "mismatch"
                                      and s.events == ("canary mismatch",) for s in spans), 30)
