"""Decode servers failing mid-stream behind the proxy (1P3D, real servers and NIXL), one
after another: the requests a failed one was decoding go on on another decode server
(proxy/migration.py), and every client gets the answer an uninterrupted run gives,
token for token: streams are resumed from the tokens their client had (greedy, seeded,
penalties, a stop string, a JSON schema, logprobs, echo, n=2, completions and chat), an
unstreamed request is run again whole (benchmarks/migration.py's kinds). Each stream's
chunks carry one id, and the servers left hold no KV after. First a server killed (its
connections lost), then one whose engine dies (it says so), then the last: with no
decode server left, each stream ends with an error event, none hangs."""

from __future__ import annotations

import contextlib
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from benchmarks.migration import KINDS, Answer, bodies, busiest_decode, differences, proxy_metrics, read
from launch import http_client
from tests.support.proxy_fakes import wait_until
from tests.support.server_harness import ServerProcess, running_proxy, running_server

pytestmark = pytest.mark.slow
TOKENS = 256  # long enough to be mid-stream when the server dies
WORK = bodies(len(KINDS), TOKENS)  # one of each kind


@pytest.fixture(scope="module")
def deployment(tiny_models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("migration")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    model = tiny_models["qwen3"]
    with contextlib.ExitStack() as stack:
        start = lambda name, *args: stack.enter_context(  # noqa: E731
            running_server(model, logs / f"{name}.log", *args))
        p = start("p", "--role", "prefill")
        d0, d1, d2 = (start(f"d{i}", "--role", "decode") for i in range(3))
        front = stack.enter_context(running_proxy(
            logs / "proxy.log", "--prefill", p.url, "--decode", d0.url, d1.url, d2.url, "--policy", "round_robin",
            "--probe-interval", "3600", "--log-level", "info"))
        yield {"p": p, "d": [d0, d1, d2], "proxy": front}


@pytest.fixture(scope="module")
def reference(deployment):
    """Every request's answer, uninterrupted."""
    return [read(deployment["proxy"].url, body) for _, body in WORK]


def metric(front, sample: str) -> float:
    return proxy_metrics(front.url, "pd_proxy").get(sample, 0.0)


def run_and_fail(front, fail) -> list[Answer]:
    """Every request of WORK sent at once, `fail()` called once every stream is under way
    (or, a short one, done); their answers."""
    answers = [Answer() for _ in WORK]
    with ThreadPoolExecutor(len(WORK)) as pool:
        futures = [pool.submit(read, front.url, body, answer) for (_, body), answer in zip(WORK, answers)]
        streams = [(a, f) for (_, body), a, f in zip(WORK, answers, futures) if body.get("stream")]
        assert wait_until(lambda: all(a.chunks >= 4 or f.done() for a, f in streams), 120)
        fail()
        for future in futures:
            future.result(timeout=120)
    return answers


def migrations(front, outcome: str) -> float:
    return sum(metric(front, f'pd_proxy_migrations_total{{outcome="{outcome}",reason="{reason}"}}')
               for reason in ("connection", "engine_died"))


def assert_as_uninterrupted(answers: list[Answer], expected: list[Answer]) -> None:
    problems = {name: diff for (name, _), got, want in zip(WORK, answers, expected)
                if (diff := differences(got, want))}
    assert problems == {}


def busiest(deployment) -> ServerProcess:
    """The decode server left with most requests in flight, as the proxy counts them."""
    url = busiest_decode(deployment["proxy"].url, {d.url for d in deployment["d"] if d.process.poll() is None})
    return next(d for d in deployment["d"] if d.url == url)


def test_a_decode_server_killed_mid_stream_costs_its_clients_nothing(deployment, reference) -> None:
    front, p = deployment["proxy"], deployment["p"]
    killed = []

    def kill() -> None:
        killed.append(busiest(deployment))
        killed[0].process.send_signal(signal.SIGKILL)  # a server this test started
        killed[0].process.wait(30)

    assert_as_uninterrupted(run_and_fail(front, kill), reference)
    resumed = metric(front, 'pd_proxy_migrations_total{outcome="resumed",reason="connection"}')
    assert resumed >= 1, "no stream was on the killed server: the test proved nothing"
    assert migrations(front, "failed") == 0
    assert metric(front, "pd_proxy_migration_pause_seconds_count") == resumed
    assert metric(front, 'pd_proxy_migrated_tokens_total{how="replayed"}') > 0
    listed = http_client().get(f"{front.url}/dashboard/state", timeout=10).json()["requests"]  # the dashboard's
    moved = [m for r in listed for m in r["migrations"]]
    assert sum(m.startswith("resumed on ") for m in moved) == resumed and killed[0].url not in " ".join(moved)
    for server in [p, *(d for d in deployment["d"] if d is not killed[0])]:
        assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0
    again = read(front.url, WORK[0][1])  # and the proxy serves on, around the dead server
    assert differences(again, reference[0]) == []


def test_a_decode_server_whose_engine_dies_mid_stream_costs_its_clients_nothing(deployment, reference) -> None:
    front, p = deployment["proxy"], deployment["p"]
    before = migrations(front, "resumed")
    died = []

    def kill_engine() -> None:
        died.append(busiest(deployment))
        os.kill(died[0].engine_pid, signal.SIGKILL)  # its server's child: the server says so, and exits

    assert_as_uninterrupted(run_and_fail(front, kill_engine), reference)
    assert migrations(front, "resumed") > before and migrations(front, "failed") == 0
    assert died[0].process.wait(30) == 1
    for server in [p, *(d for d in deployment["d"] if d.process.poll() is None)]:
        assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0


def test_with_no_decode_server_left_each_stream_ends_with_an_error_event(deployment) -> None:
    front, p = deployment["proxy"], deployment["p"]
    (last,) = [d for d in deployment["d"] if d.process.poll() is None]

    def kill() -> None:
        last.process.send_signal(signal.SIGKILL)
        last.process.wait(30)

    cut = [a for a in run_and_fail(front, kill) if a.errors]
    assert cut, "no request was on the last server"
    for answer in cut:  # a stream's error event, or an unstreamed request's 502 / 503
        (error,) = answer.errors
        assert error["error"]["type"] in ("bad_gateway", "service_unavailable"), error
        assert "failed" in error["error"]["message"] or "no healthy decode instance" in error["error"]["message"]
    assert migrations(front, "failed") >= 1  # (a request that came after found no decode server at all: 503)
    assert p.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0


def test_a_decode_server_frozen_mid_stream_is_given_up_when_its_lease_ends_and_the_stream_goes_on(
        tiny_models, tmp_path) -> None:
    """A server cut off or frozen keeps its connections open: nothing breaks, and only its
    lease ending says it is gone. The proxy looks at a silent stream's server every
    WATCH_S; once it is out of the fleet, the stream is resumed on another."""
    lease_s = 2.0
    body = {"prompt": "The keeper of the lighthouse wrote down every ship. ", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    with contextlib.ExitStack() as stack:
        front = stack.enter_context(running_proxy(tmp_path / "proxy.log", "--admin-key", "k", "--log-level", "info"))
        joining = ("--register", front.url, "--register-lease", str(lease_s))
        start = lambda name, *args: stack.enter_context(  # noqa: E731
            running_server(tiny_models["qwen3"], tmp_path / f"{name}.log", *args, *joining))
        p, d0, d1 = start("p", "--role", "prefill"), start("d0", "--role", "decode"), start("d1", "--role", "decode")
        assert wait_until(lambda: len(http_client().get(f"{front.url}/health", timeout=5).json()["decode"]) == 2, 30)
        reference = read(front.url, body)
        answer = Answer()
        with ThreadPoolExecutor(1) as pool:
            reading = pool.submit(read, front.url, body, answer)
            assert wait_until(lambda: answer.chunks >= 8, 60)
            url = busiest_decode(front.url)
            frozen = d0 if d0.url == url else d1
            os.kill(frozen.process.pid, signal.SIGSTOP)  # a server this test started
            stack.callback(os.kill, frozen.process.pid, signal.SIGCONT)  # so that it can be stopped after
            reading.result(timeout=60)
        assert differences(answer, reference) == []
        assert answer.longest_pause_s >= lease_s / 2  # it stood still until the lease ended
        assert metric(front, 'pd_proxy_migrations_total{outcome="resumed",reason="gone"}') == 1
        for server in (p, d1 if frozen is d0 else d0):
            assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0
