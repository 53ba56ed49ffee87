"""2P2D on one machine behind one proxy per policy: each policy spreads requests as it
claims, asserted from the servers' own request counters."""

from __future__ import annotations

import contextlib
import os

import pytest

from launch import http_client
from tests.support.server_harness import running_proxy, running_server

pytestmark = pytest.mark.slow
FAMILY = "Shared instructions for every request of family {family}: answer briefly and in order. " * 4


@pytest.fixture(scope="module")
def servers(tiny_models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("policies")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with contextlib.ExitStack() as stack:
        start = lambda name, *args: stack.enter_context(  # noqa: E731
            running_server(tiny_models["qwen3"], logs / f"{name}.log", *args))
        servers = {"p": [start("p0", "--role", "prefill"), start("p1", "--role", "prefill")],
                   "d": [start("d0", "--role", "decode"), start("d1", "--role", "decode")]}
        servers["logs"] = logs
        yield servers


@contextlib.contextmanager
def proxy_with(servers, policy: str):
    with running_proxy(servers["logs"] / f"proxy-{policy}.log", "--policy", policy,
                       "--prefill", *(s.url for s in servers["p"]),
                       "--decode", *(s.url for s in servers["d"])) as proxy:
        yield proxy


def finished(server) -> float:
    return sum(v for k, v in server.metrics().items() if k.startswith("pd_request_success_total"))


def counts(servers) -> list[float]:
    return [finished(s) for s in servers["p"] + servers["d"]]


def send(proxy, prompt: str) -> None:
    response = http_client().post(f"{proxy.url}/v1/completions", timeout=60,
                                  json={"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text


def delta(servers, before: list[float]) -> list[float]:
    return [after - b for after, b in zip(counts(servers), before)]


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded"])
def test_sequential_requests_alternate_evenly(servers, policy) -> None:
    with proxy_with(servers, policy) as proxy:
        before = counts(servers)
        for i in range(8):
            send(proxy, f"request number {i} about the weather")
        assert delta(servers, before) == [4, 4, 4, 4]  # P0, P1, D0, D1


def test_prefix_aware_keeps_each_family_on_one_p_and_one_d(servers) -> None:
    with proxy_with(servers, "prefix_aware") as proxy:
        for family in range(4):
            before = counts(servers)
            for question in range(5):
                send(proxy, FAMILY.format(family=family) + f"Question {question}?")
            p0, p1, d0, d1 = delta(servers, before)
            assert sorted([p0, p1]) == [0, 5] and sorted([d0, d1]) == [0, 5], (family, p0, p1, d0, d1)
        # the D of a family also serves its prefix-cache hits there
        hits = sum(s.metrics()["pd_prefix_cache_hits_total"] for s in servers["d"])
        assert hits > 0
