"""The proxy in front of fake prefill and decode servers that refuse, fail or vanish:
which answers count against an instance's breaker, what the client gets, and when P is
asked to release the blocks it keeps for a request no decode server will read."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from launch import http_client
from tests.support.proxy_fakes import (
    FakeServer,
    Reply,
    closing_kept_alive,
    error,
    fake,
    hanging_up,
    proxy_health,
    proxy_in_front,
    proxy_metric,
    refusing_port,
    vanishing,
    wait_until,
)

pytestmark = pytest.mark.slow  # seconds per test of real sockets, servers and timeouts
BODY = {"prompt": "Hello there", "max_tokens": 4}


def post(proxy: str, body: dict | None = None, **kwargs) -> httpx.Response:
    return http_client().post(f"{proxy}/v1/completions", json=body or BODY, timeout=kwargs.pop("timeout", 30), **kwargs)


def releases(proxy: str, result: str = "released") -> float:
    return proxy_metric(proxy, f'pd_proxy_kv_releases_total{{result="{result}"}}')


@pytest.fixture
def servers():
    """Two fake prefill servers and one fake decode server."""
    with fake("prefill") as p1, fake("prefill") as p2, fake("decode") as d:
        yield p1, p2, d


# ---- the prefill server's answers --------------------------------------------------


@pytest.mark.parametrize("status", [400, 422])
def test_a_prefill_verdict_is_passed_back_and_leaves_every_server_healthy(servers, status) -> None:
    p1, p2, d = servers
    p1.default = p2.default = error("bad_field", status)
    with proxy_in_front([p1.url, p2.url], [d.url]) as proxy:
        response = post(proxy)
        assert response.status_code == status
        assert response.json() == p1.default.body  # the server's own JSON body
        assert len(p1.received) + len(p2.received) == 1  # no other P is tried for a 4xx
        assert d.received == [] and p1.releases == p2.releases == []
        assert all(i["healthy"] for i in proxy_health(proxy).values())


@pytest.mark.parametrize(("reply", "healthy"), [(error("internal_error", 500), True),
                                               (error("engine_died", 500), False)])
def test_a_prefill_5xx_is_passed_back_and_not_tried_on_another_p(servers, reply, healthy) -> None:
    """Issue 31 row 1: a request that crashed a P (the server answers 500 engine_died, or
    drops the connection) was retried on the next P, and crashed it too: one request
    took down both prefill servers of a 2P1D. Without migration (--migration-limit 0) a
    P's failure serving a request may be the request's doing, so it is not retried
    elsewhere."""
    p1, p2, d = servers
    p1.default = reply
    with proxy_in_front([p1.url, p2.url], [d.url], migration_limit=0) as proxy:
        response = post(proxy)
        assert response.status_code == 500 and response.json() == reply.body  # the P's own body
        assert len(p1.received) == 1 and p2.received == [] and d.received == []
        assert proxy_health(proxy)[p1.url]["healthy"] is healthy  # engine_died counts against its breaker
        assert proxy_metric(proxy, 'pd_proxy_retries_total{role="prefill"}') == 0
        p1.default = Reply()
        assert post(proxy).status_code == 200 and len(d.received) == 1


def test_engine_dead_marks_the_prefill_server_unhealthy_and_another_serves(servers) -> None:
    p1, p2, d = servers
    p1.default = error("engine_dead", 503)
    with proxy_in_front([p1.url, p2.url], [d.url]) as proxy:
        assert post(proxy).status_code == 200
        state = proxy_health(proxy)
        assert not state[p1.url]["healthy"] and "engine_dead" in state[p1.url]["last_error"]
        assert state[p2.url]["healthy"] and len(p1.received) == len(p2.received) == 1
        assert post(proxy).status_code == 200 and len(p1.received) == 1  # P1 is skipped now


def test_kv_held_limit_tries_another_prefill_server_and_keeps_the_first_healthy(servers) -> None:
    p1, p2, d = servers
    p1.replies = [error("kv_held_limit", 503, **{"Retry-After": "7"})]
    with proxy_in_front([p1.url, p2.url], [d.url]) as proxy:
        assert post(proxy).status_code == 200
        assert len(p1.received) == len(p2.received) == len(d.received) == 1
        assert all(i["healthy"] for i in proxy_health(proxy).values())


def test_without_a_queue_kv_held_limit_everywhere_is_a_503_with_the_soonest_retry_after(servers) -> None:
    p1, p2, d = servers
    p1.default = error("kv_held_limit", 503, **{"Retry-After": "7"})
    p2.default = error("kv_held_limit", 503, **{"Retry-After": "3"})
    with proxy_in_front([p1.url, p2.url], [d.url], max_queue=0) as proxy:
        response = post(proxy)
        assert response.status_code == 503 and response.headers["retry-after"] == "3"
        assert response.json()["error"]["code"] == "kv_held_limit"
        assert len(p1.received) == len(p2.received) == 1 and d.received == []
        assert all(i["healthy"] for i in proxy_health(proxy).values())


@contextlib.contextmanager
def slow_prefill():
    with fake("prefill") as p:
        p.default = Reply(delay_s=30)
        yield p.url


def test_the_proxy_knows_every_servers_health_from_its_start(servers) -> None:
    """Probed before the proxy serves (it showed every server up until its first probe,
    an interval later): a server down at start is down in /health and gets no request."""
    p1, _, d = servers
    with refusing_port() as dead, proxy_in_front([dead, p1.url], [d.url]) as proxy:  # the prober's interval: 1 h
        state = proxy_health(proxy)
        assert state[dead]["probed"] and not state[dead]["healthy"] and state[dead]["breaker"] == "open"
        assert state[p1.url]["probed"] and state[p1.url]["healthy"] and state[d.url]["healthy"]
        assert post(proxy).status_code == 200 and len(p1.received) == 1


def test_a_request_timing_out_on_a_kept_alive_connection_is_not_tried_on_another_server(servers) -> None:
    """A response that does not come in time is not the keep-alive race (a connection
    closed as the request was written): the server had the request, which may be what
    hangs it. (The connection the proxy's probe opened is kept alive for the first one.)"""
    p1, p2, d = servers
    with proxy_in_front([p1.url, p2.url], [d.url], timeout_s=1.0, migration_limit=0) as proxy:
        assert post(proxy).status_code == 200 and post(proxy).status_code == 200  # a kept connection to each
        p1.default = Reply(delay_s=30)
        response = post(proxy)  # round robin: p1 again, on its kept connection
        assert response.status_code == 502 and "not tried on another" in response.json()["error"]["message"]
        assert len(p2.received) == 1


def test_an_unreachable_prefill_server_is_marked_unhealthy_and_the_next_serves(servers) -> None:
    p1, _, d = servers
    with refusing_port() as dead, proxy_in_front([dead, p1.url], [d.url], timeout_s=1.0) as proxy:
        assert post(proxy).status_code == 200
        state = proxy_health(proxy)
        assert not state[dead]["healthy"] and state[dead]["failures"] == 1
        assert state[p1.url]["healthy"] and len(p1.received) == len(d.received) == 1


@pytest.mark.parametrize("broken", [hanging_up, slow_prefill], ids=["hang-up", "timeout"])
def test_a_prefill_server_failing_with_the_request_is_a_502_not_retried_and_the_next_goes_elsewhere(
        servers, broken) -> None:
    """Without migration (--migration-limit 0); with it, see the test below."""
    p1, _, d = servers
    with broken() as dead, proxy_in_front([dead, p1.url], [d.url], timeout_s=1.0, migration_limit=0) as proxy:
        response = post(proxy)
        assert response.status_code == 502 and "not tried on another" in response.json()["error"]["message"]
        assert p1.received == [] and d.received == []
        state = proxy_health(proxy)
        assert not state[dead]["healthy"] and state[dead]["failures"] == 1
        assert post(proxy).status_code == 200 and len(p1.received) == len(d.received) == 1


def test_with_migration_a_prefill_server_dying_with_the_request_is_replaced_and_a_5xx_of_its_own_is_not(
        servers) -> None:
    """Issue 57: nothing of the answer has reached the client while P computes it, so a P
    whose engine died serving it (or whose connection broke) is replaced by another, at
    most --max-retries times; a 500 of its own (internal_error) is still its verdict."""
    p1, p2, d = servers
    p1.default = error("engine_died", 500)
    with proxy_in_front([p1.url, p2.url], [d.url], max_retries=1) as proxy:
        assert post(proxy).status_code == 200 and len(p1.received) == len(p2.received) == len(d.received) == 1
        assert proxy_metric(proxy, 'pd_proxy_retries_total{role="prefill"}') == 1
        p2.default = error("engine_died", 500)  # a request that kills every P walks --max-retries + 1 of them
        response = post(proxy)
        assert response.status_code in (500, 503) and len(p1.received) + len(p2.received) <= 4
    with hanging_up() as dead, proxy_in_front([dead, p1.url], [d.url]) as proxy:
        p1.default = Reply()
        assert post(proxy).status_code == 200
    p1.default = error("internal_error", 500)
    with proxy_in_front([p1.url, p2.url], [d.url]) as proxy:
        assert post(proxy).status_code == 500


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_kept_alive_connection_closed_unanswered_is_retried_on_another_server(servers, role) -> None:
    """A server stopping closes its idle connections; a request written on one as it
    closes never reached it: sent to the next P (or D, which reads P's blocks instead)."""
    p1, _, d = servers
    with fake(role) as behind, closing_kept_alive(behind.url) as closing:
        other = p1 if role == "prefill" else d
        urls = {"prefill": [p1.url], "decode": [d.url]}
        urls[role] = [closing, other.url]
        with proxy_in_front(urls["prefill"], urls["decode"], decode_policy="round_robin") as proxy:
            assert post(proxy).status_code == 200 and len(behind.received) == 1  # round robin: closing, kept alive
            assert post(proxy).status_code == 200 and len(other.received) == 1
            response = post(proxy)  # closing again, on the kept connection: closed under it
            assert response.status_code == 200, response.text
            assert len(behind.received) == 1 and len(other.received) == 2 and len(p1.received) + len(d.received) == 5
            assert not proxy_health(proxy)[closing]["healthy"]


def test_a_second_kept_alive_connection_closed_unanswered_is_a_502(servers) -> None:
    """Once per request: a request that a second P drops so is not sent to a third
    (without migration: with it, a P that dropped it is replaced like one that died)."""
    p1, p2, d = servers
    with closing_kept_alive(p2.url) as first, closing_kept_alive(p2.url) as second, \
            proxy_in_front([first, second, p1.url], [d.url], migration_limit=0) as proxy:
        assert post(proxy).status_code == 200 and post(proxy).status_code == 200  # a kept connection to each
        assert post(proxy).status_code == 200 and len(p1.received) == 1
        response = post(proxy)  # first closes under it, then second: not a third P
        assert response.status_code == 502 and "not tried on another" in response.json()["error"]["message"]
        assert len(p1.received) == 1


def test_with_every_prefill_server_unreachable_the_answer_is_503(servers) -> None:
    _, _, d = servers
    with refusing_port() as dead, proxy_in_front([dead], [d.url]) as proxy:
        response = post(proxy)
        assert response.status_code == 503 and "no healthy prefill instance" in response.json()["error"]["message"]
        assert d.received == []


def test_a_prefill_answer_without_kv_transfer_params_is_a_502(servers) -> None:
    p1, _, d = servers
    p1.default = Reply(200, {"choices": [{"text": "x"}]})
    with proxy_in_front([p1.url], [d.url]) as proxy:
        response = post(proxy)
        assert response.status_code == 502 and "kept no KV" in response.json()["error"]["message"]
        assert d.received == [] and proxy_health(proxy)[p1.url]["healthy"]


# ---- the decode server's answers, and releasing P's blocks ---------------------------


@pytest.mark.parametrize(("reply", "healthy"), [
    (error("invalid_type", 400), True),
    (error("internal_error", 500), True),
    (error("kv_load_failed", 502), True),
    (error("engine_dead", 503), False),
])
def test_a_decode_refusal_is_passed_back_and_p_releases_the_blocks_once(servers, reply, healthy) -> None:
    p1, _, d = servers
    d.default = reply
    with proxy_in_front([p1.url], [d.url]) as proxy:
        response = post(proxy, headers={"X-Request-Id": "req-1"})
        assert response.status_code == reply.status and response.json() == reply.body
        assert p1.released_ids == ["p-1"]  # exactly one release, of what P answered
        assert p1.releases[0].headers["x-request-id"] == "req-1"
        assert d.received[0].body["kv_transfer_params"]["remote_request_id"] == "p-1"
        assert proxy_health(proxy)[d.url]["healthy"] is healthy
        assert releases(proxy) == 1


def test_a_decode_server_that_accepts_gets_no_release(servers) -> None:
    p1, _, d = servers
    with proxy_in_front([p1.url], [d.url]) as proxy:
        for stream in (False, True):
            assert post(proxy, BODY | {"stream": stream}).status_code == 200
        assert len(d.received) == 2 and p1.releases == [] and releases(proxy) == 0


def test_an_unreachable_decode_server_is_skipped_for_the_next(servers) -> None:
    p1, _, d = servers
    with refusing_port() as dead, proxy_in_front([p1.url], [dead, d.url]) as proxy:
        response = post(proxy)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "fake answer"
        assert not proxy_health(proxy)[dead]["healthy"] and p1.releases == []


def test_with_no_decode_server_reachable_p_releases_and_the_next_request_skips_p(servers) -> None:
    p1, _, _ = servers
    with vanishing() as dead, proxy_in_front([p1.url], [dead.url]) as proxy:
        dead.vanish()  # since the proxy's probe at start
        response = post(proxy)
        assert response.status_code == 503 and "no healthy decode instance" in response.json()["error"]["message"]
        assert p1.released_ids == ["p-1"] and not proxy_health(proxy)[dead.url]["healthy"]
        assert post(proxy).status_code == 503
        assert len(p1.received) == 1  # D is known down: P is not asked to hold blocks again


def test_with_no_healthy_decode_server_nothing_is_sent_to_p(servers) -> None:
    p1, _, d = servers
    d.health_status = 503
    # The cool-down outlasts the checks below on a loaded machine (at 0.2 s, the request
    # itself was once D's half-open trial: sent to it).
    with proxy_in_front([p1.url], [d.url], probe_interval_s=0.05, breaker_cooldown_s=2.0) as proxy:
        assert wait_until(lambda: not proxy_health(proxy)[d.url]["healthy"])
        response = post(proxy)
        assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
        assert p1.received == [] and d.received == []
        d.health_status = 200  # the prober's trial after the cool-down closes its breaker
        # closed, not only "healthy": half-open counts as healthy, and while the prober's
        # trial is the one in flight a request finds no decode server to go to (503)
        assert wait_until(lambda: proxy_health(proxy)[d.url]["breaker"] == "closed")
        assert post(proxy).status_code == 200


@pytest.mark.parametrize(("release_reply", "result"), [
    (Reply(200, {"released": False}), "unknown"),
    (Reply(500, {"error": {"message": "boom"}}), "failed"),
])
def test_a_release_that_frees_nothing_or_fails_is_counted_and_ignored(servers, release_reply, result) -> None:
    p1, _, d = servers
    d.default = error("invalid_type", 400)
    p1.release_reply = release_reply
    with proxy_in_front([p1.url], [d.url]) as proxy:
        assert post(proxy).status_code == 400
        assert p1.released_ids == ["p-1"] and releases(proxy, result) == 1 and releases(proxy) == 0


def test_a_client_leaving_before_decode_answers_aborts_d_and_releases_p(servers) -> None:
    p1, _, d = servers
    d.default = Reply(delay_s=30)
    with proxy_in_front([p1.url], [d.url]) as proxy:
        with pytest.raises(httpx.ReadTimeout):
            post(proxy, timeout=1.0)
        assert wait_until(lambda: len(p1.releases) == 1 and d.aborted == 1)
        assert p1.released_ids == ["p-1"] and releases(proxy) == 1
        assert wait_until(lambda: proxy_health(proxy)[d.url]["outstanding"] == 0)


def test_a_client_leaving_during_prefill_aborts_p_and_sends_nothing_to_d(servers) -> None:
    p1, _, d = servers
    p1.default = Reply(delay_s=30)
    with proxy_in_front([p1.url], [d.url]) as proxy:
        with pytest.raises(httpx.ReadTimeout):
            post(proxy, timeout=1.0)
        assert wait_until(lambda: p1.aborted == 1)
        assert d.received == [] and p1.releases == []
        assert proxy_health(proxy)[p1.url]["healthy"] and proxy_health(proxy)[p1.url]["outstanding"] == 0


def test_prefill_servers_answers_are_parsed_strictly(servers) -> None:
    p1, _, d = servers
    p1.default = Reply(200, b'{"kv_transfer_params": {"remote_request_id": "\\ud800"}}')
    with proxy_in_front([p1.url], [d.url]) as proxy:
        response = post(proxy)
        assert response.status_code == 502 and "lone UTF-16 surrogate" in response.json()["error"]["message"]
        assert d.received == []


def fake_servers_are_stopped(server: FakeServer) -> bool:
    try:
        http_client().get(f"{server.url}/health", timeout=1)
    except httpx.ConnectError:
        return True
    return False


def test_the_fakes_are_stopped_when_their_fixture_ends() -> None:
    with fake("decode") as d:
        assert http_client().get(f"{d.url}/health", timeout=5).status_code == 200
    assert fake_servers_are_stopped(d)
