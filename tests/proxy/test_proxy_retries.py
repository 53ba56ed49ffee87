"""Retries, breakers and 429s through the proxy in front of fake servers: a prefill that
fails before answering is sent to another P (at most --max-retries, after a backoff);
a server that failed is shut out by its breaker until a trial succeeds; when every
server of a role has --max-outstanding requests in flight the excess get 429."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from launch import http_client
from proxy.answers import MAX_BACKOFF_S, backoff_s
from tests.support.proxy_fakes import (
    Reply,
    error,
    fake,
    proxy_health,
    proxy_in_front,
    proxy_metric,
    vanishing,
    wait_until,
)

pytestmark = pytest.mark.slow  # seconds per test of real sockets, servers and timeouts
BODY = {"prompt": "Hello there", "max_tokens": 4}


def post(proxy: str, body: dict | None = None) -> httpx.Response:
    return http_client().post(f"{proxy}/v1/completions", json=body or BODY, timeout=60)


def retries(proxy: str, role: str = "prefill") -> float:
    return proxy_metric(proxy, f'pd_proxy_retries_total{{role="{role}"}}')


def test_the_backoff_doubles_with_jitter_and_is_capped() -> None:
    for attempt in (1, 2, 3):
        waits = [backoff_s(0.1, attempt) for _ in range(200)]
        low = 0.1 * 2 ** (attempt - 1)
        assert all(low <= w < 2 * low for w in waits) and len(set(waits)) > 100  # jittered
    assert backoff_s(1.0, 30) == MAX_BACKOFF_S


def test_a_prefill_failing_before_answering_is_retried_on_each_other_p() -> None:
    with fake("prefill") as p, fake("decode") as d, vanishing() as refusing, vanishing() as dying, \
            fake("prefill") as gone:
        gone.default = error("engine_dead", 503)  # its engine was dead before the request came
        refused, dead = refusing.url, dying.url
        with proxy_in_front([refused, dead, gone.url, p.url], [d.url], max_retries=3) as proxy:
            refusing.vanish()  # both since the proxy's probe at start
            dying.vanish()
            response = post(proxy)
            assert response.status_code == 200 and response.json()["choices"][0]["text"] == "fake answer"
            state = proxy_health(proxy)
            failed = [url for url in (refused, dead, gone.url) if state[url]["failures"]]
            assert retries(proxy) == len(failed)  # one retry per P that failed before p took it
            assert all(state[url]["breaker"] == "open" and not state[url]["healthy"] for url in failed)
            assert len(p.received) == len(d.received) == 1


def test_max_retries_bounds_the_prefill_servers_tried() -> None:
    with fake("prefill") as p, fake("decode") as d, vanishing() as refused, \
            proxy_in_front([refused.url, p.url], [d.url], max_retries=0) as proxy:
        refused.vanish()  # since the proxy's probe at start
        response = post(proxy)  # round_robin takes the first one first
        assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
        assert p.received == [] and d.received == [] and retries(proxy) == 0
        assert post(proxy).status_code == 200  # its breaker is open now: the next goes to p


def test_a_breaker_stays_open_through_its_cool_down_and_a_trial_closes_it() -> None:
    with fake("prefill") as p1, fake("prefill") as p2, fake("decode") as d, \
            proxy_in_front([p1.url, p2.url], [d.url], breaker_cooldown_s=3600) as proxy:
        p1.replies = [error("engine_dead", 503)]
        for _ in range(4):
            assert post(proxy).status_code == 200
        assert len(p1.received) == 1 and len(p2.received) == 4  # shut out after its one failure
        assert proxy_metric(proxy, f'pd_proxy_instance_breaker_state{{role="prefill",url="{p1.url}"}}') == 2
    with fake("prefill") as p1, fake("prefill") as p2, fake("decode") as d, \
            proxy_in_front([p1.url, p2.url], [d.url], breaker_cooldown_s=0.05, probe_interval_s=0.02) as proxy:
        p1.replies = [error("engine_dead", 503)]
        assert post(proxy).status_code == 200
        assert proxy_health(proxy)[p1.url]["failures"] == 1
        assert wait_until(lambda: proxy_health(proxy)[p1.url]["breaker"] == "closed")  # the prober's trial
        assert proxy_metric(proxy, f'pd_proxy_instance_breaker_state{{role="prefill",url="{p1.url}"}}') == 0


def test_failures_below_the_threshold_leave_the_breaker_closed() -> None:
    with fake("prefill") as p1, fake("prefill") as p2, fake("decode") as d, \
            proxy_in_front([p1.url, p2.url], [d.url], breaker_failures=3, policy="least_loaded") as proxy:
        p1.replies = [error("engine_dead", 503)] * 2
        for _ in range(6):
            assert post(proxy).status_code == 200
        state = proxy_health(proxy)[p1.url]
        assert state["failures"] == 2 and state["breaker"] == "closed" and len(p1.received) > 2


@pytest.mark.parametrize("slow_role", ["prefill", "decode"])
def test_without_a_queue_past_max_outstanding_everywhere_the_excess_get_429_and_the_rest_complete(slow_role) -> None:
    with fake("prefill") as p, fake("decode") as d, \
            proxy_in_front([p.url], [d.url], max_outstanding=2, max_queue=0) as proxy:
        # it holds two in flight (a request is in flight on D from the moment D is picked)
        (p if slow_role == "prefill" else d).default = Reply(delay_s=3)
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: post(proxy), range(8)))
        done = [a for a in answers if a.status_code == 200]
        refused = [a for a in answers if a.status_code == 429]
        assert len(done) == 2 and len(refused) == 6, [a.status_code for a in answers]
        assert all(a.headers["retry-after"] == "1" and a.json()["error"]["code"] == "overloaded" for a in refused)
        assert sum(proxy_metric(proxy, f'pd_proxy_overloaded_total{{role="{role}"}}')
                   for role in ("prefill", "decode")) == 6
        assert len(p.received) == 2  # a refused request sent nothing to P
        state = proxy_health(proxy)
        assert all(i["outstanding"] == 0 and i["healthy"] for i in state.values())
        (p if slow_role == "prefill" else d).default = Reply()
        assert post(proxy).status_code == 200


def test_without_a_queue_a_full_prefill_server_is_a_429_too_and_frees_the_decode_server_picked() -> None:
    with fake("prefill") as p, fake("decode") as d1, fake("decode") as d2, \
            proxy_in_front([p.url], [d1.url, d2.url], max_outstanding=1, max_queue=0) as proxy, \
            ThreadPoolExecutor(1) as pool:
        p.default = Reply(delay_s=3)
        first = pool.submit(post, proxy)
        assert wait_until(lambda: len(p.received) == 1)
        refused = post(proxy)  # a D is free, P is not
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert proxy_metric(proxy, 'pd_proxy_overloaded_total{role="prefill"}') == 1
        assert first.result().status_code == 200
        assert all(i["outstanding"] == 0 for i in proxy_health(proxy).values())
        p.default = Reply()
        assert [post(proxy).status_code for _ in range(2)] == [200, 200]  # nothing stays bound


def test_past_max_outstanding_everywhere_requests_wait_in_the_queue_and_all_complete() -> None:
    """Issue 31 row 7: no room is back-pressure to the proxy's queue, not an answer."""
    with fake("prefill") as p, fake("decode") as d, proxy_in_front([p.url], [d.url], max_outstanding=2) as proxy:
        d.default = Reply(delay_s=0.5)
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: post(proxy), range(8)))
        assert [a.status_code for a in answers] == [200] * 8
        assert proxy_metric(proxy, "pd_proxy_queued_total") >= 1
        assert proxy_metric(proxy, 'pd_proxy_overloaded_total{role="decode"}') == 0
        assert proxy_metric(proxy, "pd_proxy_queue_waiting") == 0
        assert all(i["outstanding"] == 0 for i in proxy_health(proxy).values())


def test_past_max_queue_the_excess_get_429_with_retry_after_and_a_queue_timeout_too() -> None:
    with fake("prefill") as p, fake("decode") as d, \
            proxy_in_front([p.url], [d.url], max_outstanding=1, max_queue=2, queue_timeout_s=30) as proxy:
        d.default = Reply(delay_s=2)
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: post(proxy), range(6)))
        done = [a for a in answers if a.status_code == 200]
        full = [a for a in answers if a.status_code == 429]
        assert len(done) >= 3 and len(done) + len(full) == 6 and full, [a.status_code for a in answers]
        assert all(a.headers["retry-after"] == "1" and a.json()["error"]["code"] == "queue_full" for a in full)
        assert proxy_metric(proxy, 'pd_proxy_queue_refused_total{reason="full"}') == len(full)
    with fake("prefill") as p, fake("decode") as d, \
            proxy_in_front([p.url], [d.url], max_outstanding=1, queue_timeout_s=0.5) as proxy:
        d.default = Reply(delay_s=3)
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(post, proxy)
            assert wait_until(lambda: len(d.received) == 1)
            late = post(proxy)
        assert late.status_code == 429 and late.json()["error"]["code"] == "queue_timeout"
        assert first.result().status_code == 200


def test_every_prefill_server_holding_too_much_is_back_pressure_not_an_answer() -> None:
    with fake("prefill") as p, fake("decode") as d, proxy_in_front([p.url], [d.url]) as proxy:
        p.replies = [error("kv_held_limit", 503, **{"Retry-After": "1"})] * 3  # then it takes them
        answer = post(proxy)
        assert answer.status_code == 200 and len(p.received) == 4
        assert proxy_metric(proxy, "pd_proxy_queued_total") == 1


def test_a_priority_outside_32_bits_or_not_an_integer_is_a_400() -> None:
    with fake("prefill") as p, fake("decode") as d, proxy_in_front([p.url], [d.url]) as proxy:
        for bad in ("high", 2**40, 1.5, True):
            response = http_client().post(f"{proxy}/v1/completions", json=BODY | {"priority": bad}, timeout=10)
            assert response.status_code == 400 and response.json()["error"]["param"] == "priority", response.text
        assert p.received == [] and post(proxy).status_code == 200


def test_a_priority_more_urgent_than_the_proxy_allows_is_a_400() -> None:
    """Any client could send -2^31 and go ahead of every other: by default a client may
    only defer its own requests; --max-client-priority lets it ask more."""
    with fake("prefill") as p, fake("decode") as d, proxy_in_front([p.url], [d.url]) as proxy:
        for bad in (-1, -2**31):
            response = http_client().post(f"{proxy}/v1/completions", json=BODY | {"priority": bad}, timeout=10)
            assert response.status_code == 400 and response.json()["error"]["param"] == "priority", response.text
            assert "more urgent than this proxy lets a client ask (at most 0" in response.json()["error"]["message"]
        assert p.received == []
        for fine in (0, 7, 2**31 - 1):
            assert post(proxy, BODY | {"priority": fine}).status_code == 200
    with fake("prefill") as p, fake("decode") as d, proxy_in_front([p.url], [d.url], max_client_priority=-5) as proxy:
        assert post(proxy, BODY | {"priority": -5}).status_code == 200
        assert post(proxy, BODY | {"priority": -6}).status_code == 400


def test_a_priority_orders_the_proxys_queue_and_is_not_sent_to_the_servers() -> None:
    """pd serve refuses a field it does not take (400 "priority is not supported"): the
    proxy, whose queue the field orders, keeps it."""
    with fake("prefill") as p, fake("decode") as d, proxy_in_front([p.url], [d.url], max_client_priority=-3) as proxy:
        response = http_client().post(f"{proxy}/v1/completions", json=BODY | {"priority": -3}, timeout=10)
        assert response.status_code == 200, response.text
        assert [r.body for r in p.received + d.received if "priority" in r.body] == []
