"""A prefill server killed mid-run behind the proxy (2P1D, real servers and NIXL): the
requests it was to prefill, and those it held when it died, are retried on the other P
and complete with the same tokens; its breaker opens and the proxy stops sending to it
(one trial per cool-down at most); when the server comes back on its port the breaker
closes and it takes requests again.
And 4x more concurrent requests than --max-outstanding allows: those past --max-queue
get 429 with Retry-After, the rest (some queued) complete, and nothing is left in flight."""

from __future__ import annotations

import contextlib
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from launch import http_client
from tests.support.proxy_fakes import wait_until
from tests.support.server_harness import free_port, running_proxy, running_server

pytestmark = pytest.mark.slow
PROMPTS = [f"Report {i} from the lighthouse: " + "the lamp turned and the fog horn answered. " * (2 + i)
           for i in range(4)]
COOLDOWN_S = 2.0
# No /health probes: the first request sent to the dead server finds it down (and is
# retried), and half-open trials are client requests.


@pytest.fixture(scope="module")
def deployment(tiny_models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("failover")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    model = tiny_models["qwen3"]
    p0_port = free_port()
    with contextlib.ExitStack() as stack:
        start = lambda name, *args, **kw: stack.enter_context(  # noqa: E731
            running_server(model, logs / f"{name}.log", *args, **kw))
        p0 = start("p0", "--role", "prefill", port=p0_port)
        p1 = start("p1", "--role", "prefill")
        d = start("d", "--role", "decode")
        front = stack.enter_context(running_proxy(
            logs / "proxy.log", "--prefill", p0.url, p1.url, "--decode", d.url, "--probe-interval", "3600",
            "--breaker-cooldown", str(COOLDOWN_S), "--max-retries", "2", "--max-outstanding", "2", "--max-queue", "2",
            "--log-level", "warning"))
        yield {"p0": p0, "p1": p1, "d": d, "proxy": front, "model": model, "logs": logs, "p0_port": p0_port}


def complete(front, prompt: str, max_tokens: int = 8) -> httpx.Response:
    return http_client().post(f"{front.url}/v1/completions", timeout=120,
                              json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def instance(front, url: str) -> dict:
    health = http_client().get(f"{front.url}/health", timeout=5).json()
    return next(i for i in health["prefill"] + health["decode"] if i["url"] == url)


def metric(front, sample: str) -> float:
    for line in http_client().get(f"{front.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rpartition(" ")[2])
    raise AssertionError(f"{sample} is not in the proxy's /metrics")


def test_a_prefill_server_killed_mid_run_is_failed_over_shut_out_and_taken_back(deployment) -> None:
    front, p0, p1, d = deployment["proxy"], deployment["p0"], deployment["p1"], deployment["d"]
    reference = {prompt: text(complete(front, prompt)) for prompt in PROMPTS}
    d_pid = d.health().json()["engine_pid"]
    with ThreadPoolExecutor(2) as pool:  # two clients at a time (the proxy takes 2 per server)
        running = [pool.submit(complete, front, PROMPTS[i % len(PROMPTS)]) for i in range(24)]
        assert wait_until(lambda: sum(f.done() for f in running) >= 4, 120)
        p0.process.send_signal(signal.SIGKILL)  # mid-run: requests are still being sent
        p0.process.wait(30)
        answers = [f.result() for f in running]
    # A request P held when it died is sent to the other P (nothing of it had reached its
    # client: migration, issue 57), as is one that could not reach it: each is answered
    # as before, and the death opened P's breaker.
    assert [text(a) for a in answers] == [reference[PROMPTS[i % len(PROMPTS)]] for i in range(24)]
    assert metric(front, 'pd_proxy_retries_total{role="prefill"}') >= 1
    assert instance(front, p0.url)["breaker"] != "closed" and instance(front, p0.url)["failures"] >= 1

    before = instance(front, p0.url)
    retries_before = metric(front, 'pd_proxy_retries_total{role="prefill"}')
    for i in range(12):  # while it is down: shut out, but for one trial per cool-down, each one failing
        assert text(complete(front, PROMPTS[i % len(PROMPTS)])) == reference[PROMPTS[i % len(PROMPTS)]]
        assert instance(front, p0.url)["breaker"] != "closed"
    trials = instance(front, p0.url)["requests"] - before["requests"]
    assert instance(front, p0.url)["failures"] - before["failures"] == trials  # every one sent to it failed
    assert metric(front, 'pd_proxy_retries_total{role="prefill"}') - retries_before == trials  # and was retried

    with running_server(deployment["model"], deployment["logs"] / "p0-restarted.log", "--role", "prefill",
                        port=deployment["p0_port"]):
        assert wait_until(lambda: text(complete(front, PROMPTS[0])) == reference[PROMPTS[0]] and
                          instance(front, p0.url)["breaker"] == "closed", 60)  # a request's trial closed it
        sent_before = instance(front, p0.url)["requests"]
        for prompt in PROMPTS:
            assert text(complete(front, prompt)) == reference[prompt]
        assert instance(front, p0.url)["requests"] > sent_before  # taken again
    assert d.health().json()["engine_pid"] == d_pid
    assert wait_until(lambda: d.metrics()["pd_kv_cache_usage"] == 0 and p1.metrics()["pd_kv_requests_held"] == 0, 60)


def test_four_times_max_outstanding_at_once_queue_within_max_queue_and_the_excess_get_429(deployment) -> None:
    front, d = deployment["proxy"], deployment["d"]
    with ThreadPoolExecutor(8) as pool:  # one decode server taking 2 at most, 2 more may wait: 8 at once is 4x
        answers = list(pool.map(lambda i: complete(front, PROMPTS[i % len(PROMPTS)], max_tokens=96), range(8)))
    done = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 429]
    assert len(done) + len(refused) == 8 and len(done) >= 4 and refused, [a.status_code for a in answers]
    assert all(a.json()["usage"]["completion_tokens"] == 96 for a in done)
    assert all(a.headers["retry-after"] == "1" and a.json()["error"]["code"] == "queue_full" for a in refused)
    health = http_client().get(f"{front.url}/health", timeout=5).json()
    assert all(i["outstanding"] == 0 for i in health["prefill"] + health["decode"])
    assert wait_until(lambda: d.metrics()["pd_kv_cache_usage"] == 0, 60)
    assert complete(front, PROMPTS[0]).status_code == 200
