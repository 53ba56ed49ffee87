"""The dashboard's routes (proxy/dashboard.py, proxy/recent.py) in front of fake servers:
what /dashboard/state says of the instances and the last requests, and the API key on
both routes. The page itself, in a real browser: test_dashboard_browser.py."""

from __future__ import annotations

import socket

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.responses import JSONResponse

from launch import http_client
from proxy.dashboard import PAGE_HEADERS, Sample, parse_samples, sample
from proxy.recent import RECENT_REQUESTS, RecentRequests
from tests.support.proxy_fakes import fake, proxy_in_front, wait_until
from tests.support.server_harness import running_proxy

KEY = "dash-key"
BODY = {"prompt": "Hello there", "max_tokens": 4}
SERVER_METRICS = """# HELP pd_kv_cache_usage Fraction of KV cache blocks in use (0..1).
pd_kv_cache_usage 0.25
pd_prefix_cache_queries_total 200.0
pd_prefix_cache_queries_total{group="full"} 999.0
pd_prefix_cache_hits_total 50.0
pd_kv_transfer_bytes_total %d
"""


def state(proxy: str, **headers: str) -> httpx.Response:
    return http_client().get(f"{proxy}/dashboard/state", headers=headers, timeout=10)


def by_url(body: dict) -> dict[str, dict]:
    return {i["url"]: i for i in body["instances"]}


# ---- the ring of requests and the figures, alone -------------------------------------


def test_the_ring_keeps_the_last_requests_newest_first() -> None:
    recent = RecentRequests()
    for n in range(RECENT_REQUESTS + 7):
        recent.start(f"/e{n}").answered(JSONResponse({}, headers={"X-Request-Id": f"r{n}"}), [], [])
    listed = recent.newest_first()
    assert len(listed) == RECENT_REQUESTS
    assert listed[0]["request_id"] == f"r{RECENT_REQUESTS + 6}" and listed[-1]["request_id"] == "r7"
    assert all(r["status"] == 200 and r["total_ms"] is not None and r["ttft_ms"] is None for r in listed)


@pytest.mark.parametrize("header", ["9; overlap=0", "x", "²", "-1", "1" * 40, ""])
def test_a_route_header_naming_no_instance_leaves_the_instance_unknown(header: str) -> None:
    record = RecentRequests().start("/v1/completions")
    record.answered(JSONResponse({}, headers={"X-PD-Prefill": header, "X-PD-Decode": "1; overlap=3"}),
                    ["http://p0"], ["http://d0", "http://d1"])
    assert record.prefill is None and record.decode == "http://d1"


def test_figures_from_a_servers_metrics() -> None:
    first = sample(parse_samples(SERVER_METRICS % 1000 + "garbage line\n"), 10.0, None)
    assert (first.kv_usage, first.hit_rate, first.transfer_rate) == (0.25, 0.25, None)  # the unlabelled totals
    second = sample(parse_samples(SERVER_METRICS % 5000), 12.0, first)
    assert second.transfer_rate == 2000.0  # bytes/s between the two samples
    assert sample(None, 13.0, second) == Sample(13.0)  # no answer: nothing known
    assert sample({}, 13.0, second).hit_rate is None


# ---- the routes ----------------------------------------------------------------------


@pytest.mark.slow  # real sockets and fake servers
def test_the_state_names_every_instance_and_the_last_requests() -> None:
    with fake("prefill") as p, fake("decode") as d1, fake("decode") as d2:
        d1.metrics_text = SERVER_METRICS % 1000
        with proxy_in_front([p.url], [d1.url, d2.url]) as proxy:
            before = state(proxy).json()
            assert [(i["url"], i["role"], i["healthy"], i["breaker"]) for i in before["instances"]] == [
                (p.url, "prefill", True, "closed"), (d1.url, "decode", True, "closed"),
                (d2.url, "decode", True, "closed")]
            assert before["requests"] == [] and before["disagg_policy"] == "always"
            assert by_url(before)[d1.url]["kv_usage"] == 0.25 and by_url(before)[d1.url]["hit_rate"] == 0.25
            assert by_url(before)[d2.url]["kv_usage"] is None  # its /metrics answers 404: unknown
            d1.metrics_text = SERVER_METRICS % 3000
            assert wait_until(lambda: (by_url(state(proxy).json())[d1.url]["transfer_rate"] or 0) > 0, 10)

            plain = http_client().post(f"{proxy}/v1/completions", json=BODY, timeout=30)
            streamed = http_client().post(f"{proxy}/v1/completions", json=BODY | {"stream": True}, timeout=30)
            assert plain.status_code == streamed.status_code == 200
            assert http_client().post(f"{proxy}/v1/completions", content=b"{", timeout=30).status_code == 400
            bad, last, first = state(proxy).json()["requests"][:3]
            decoders = {first["decode"], last["decode"]}
            assert decoders == {d1.url, d2.url}  # round robin
            for record, answer in ((first, plain), (last, streamed)):
                assert record["request_id"] == answer.headers["x-request-id"]
                assert (record["status"], record["path"], record["prefill"]) == (200, "disaggregated", p.url)
                assert record["total_ms"] is not None
            assert first["ttft_ms"] is None and last["ttft_ms"] is not None  # only a stream has a first chunk
            assert (bad["status"], bad["path"], bad["decode"]) == (400, None, None)


@pytest.mark.slow
def test_both_routes_need_the_key_and_the_page_takes_it_in_its_query() -> None:
    with fake("prefill") as p, fake("decode") as d, proxy_in_front([p.url], [d.url], api_key=KEY) as proxy:
        client = http_client()
        for path in ("/dashboard", "/dashboard/state", f"/dashboard?key=wrong{KEY}", f"/dashboard/state?key={KEY}"):
            refused = client.get(proxy + path, timeout=10)
            assert refused.status_code == 401, path
            assert refused.json()["error"]["code"] == "invalid_api_key"
        assert state(proxy, Authorization=f"Bearer {KEY}").json()["instances"][0]["url"] == p.url
        for headers, path in (({}, f"/dashboard?key={KEY}"), ({"Authorization": f"Bearer {KEY}"}, "/dashboard")):
            page = client.get(proxy + path, headers=headers, timeout=10)
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            assert page.headers["content-security-policy"] == PAGE_HEADERS["Content-Security-Policy"]
            assert "<script>" in page.text and "innerHTML" not in page.text
        assert client.get(f"{proxy}/health", timeout=10).status_code == 200  # the one open route


@pytest.mark.slow
def test_any_key_in_the_query_or_header_but_the_right_one_is_a_401() -> None:
    """The page's key comes in its query, a new input: random queries (raw, percent
    escapes that are not UTF-8 among them) and Authorization headers get 401, never a 5xx."""
    queries = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7e), max_size=40).map(lambda q: "key=" + q)
    headers = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xff), max_size=40).map(
        lambda h: h.strip().encode("latin-1"))  # what HTTP carries in a header
    with fake("prefill") as p, fake("decode") as d, proxy_in_front([p.url], [d.url], api_key=KEY) as proxy:
        @settings(max_examples=150, deadline=None, database=None)
        @given(query=queries | st.sampled_from(["key=%ff%fe", "key=%00", "key", f"key={KEY}x", f"KEY={KEY}"]),
               authorization=st.none() | headers)
        def fuzz(query: str, authorization: bytes | None) -> None:
            headers = {} if authorization is None else {"Authorization": authorization}
            for path in ("/dashboard", "/dashboard/state"):
                response = http_client().get(httpx.URL(f"{proxy}{path}?{query}"), headers=headers, timeout=10)
                assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"

        fuzz()


@pytest.mark.slow
def test_no_spelling_of_the_key_in_a_query_reaches_the_access_log(tmp_path) -> None:
    """The check decodes the query's names (`%6Bey` is `key`): the access log of a real
    `pd proxy` never shows the key, however the request target spells it, accepted or not."""
    spellings = [f"?key={KEY}", f"?%6Bey={KEY}", f"?k%65y={KEY}", f"?KEY={KEY}", f";key={KEY}", f"?a=1&key={KEY}",
                 f"?key={KEY}&key=x", f"?%6b%65%79={KEY}", f"?key=%{KEY.encode().hex()}"]
    with fake("prefill") as p, fake("decode") as d, running_proxy(
            tmp_path / "proxy.log", "--prefill", p.url, "--decode", d.url, "--api-key", KEY,
            "--log-level", "info") as proxy:
        statuses = {spelling: raw_get(proxy.url, "/dashboard" + spelling) for spelling in spellings}
        assert statuses[f"?%6Bey={KEY}"] == statuses[f"?key={KEY}"] == 200  # decoded alike by the check
        assert raw_get(proxy.url, "/dashboard?done=1") == 401
        logged = lambda: proxy.log_path.read_text().count('"GET /dashboard') == len(spellings) + 1  # noqa: E731
        assert wait_until(logged), proxy.log_path.read_text()
        log = proxy.log_path.read_text()
    assert KEY not in log and KEY.encode().hex() not in log
    assert log.count('"GET /dashboard?*** HTTP/1.1"') == len(spellings) + 1


def raw_get(url: str, target: str) -> int:
    """GET `target` exactly as written (no client normalizes it); the status."""
    host, port = httpx.URL(url).host, httpx.URL(url).port
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        head = sock.recv(4096).decode("latin-1")
    return int(head.split(" ", 2)[1])
