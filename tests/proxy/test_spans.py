"""The proxy's spans of a request (the SDK's in-memory exporter, the proxy in this process
in front of fake servers): the client's trace continued, a route span per pick, a client
span per server call whose context is the traceparent that server got."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from launch import http_client
from telemetry import tracing
from tests.support.proxy_fakes import fake, proxy_in_front, vanishing, wait_until

pytestmark = pytest.mark.slow  # real sockets and servers
CLIENT_TRACE, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.fixture
def exported():
    exporter = InMemorySpanExporter()
    tracing.configure("pd-proxy", exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.shutdown()


def span_id(traceparent: str) -> int:
    return int(traceparent.split("-")[2], 16)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_is_one_trace_from_the_client_through_p_and_d(exported, stream) -> None:
    with fake("prefill") as p, fake("decode") as d, proxy_in_front([p.url], [d.url]) as url:
        response = http_client().post(url + "/v1/completions", timeout=30, json={
            "prompt": "Hi", "max_tokens": 2, "stream": stream},
            headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "X-Request-Id": "traced-1"})
        assert response.status_code == 200
        assert wait_until(lambda: "proxy.request" in {s.name for s in exported.get_finished_spans()}, 10)
    spans = exported.get_finished_spans()
    by_name = {s.name: s for s in spans}
    request = by_name["proxy.request"]
    assert {format(s.context.trace_id, "032x") for s in spans} == {CLIENT_TRACE}
    assert request.parent.span_id == int(CLIENT_SPAN, 16)
    assert dict(request.attributes) == {"pd.request_id": "traced-1", "http.route": "/v1/completions",
                                             "pd.stream": stream, "http.status_code": 200, "pd.path": "disaggregated"}
    routes = sorted((s for s in spans if s.name == "proxy.route"), key=lambda s: s.attributes["pd.role"])
    assert [(r.attributes["pd.role"], r.attributes["pd.instance"]) for r in routes] == [
        ("decode", d.url), ("prefill", p.url)]
    assert all(r.parent.span_id == request.context.span_id for r in routes)
    assert list(routes[1].attributes["pd.candidates"]) == [f"{p.url} in_flight=0 held_tokens=0 breaker=closed"]
    for name, server in (("proxy.prefill", p), ("proxy.decode", d)):
        call = by_name[name]
        assert call.parent.span_id == request.context.span_id and call.attributes["pd.instance"] == server.url
        assert span_id(server.received[0].headers["traceparent"]) == call.context.span_id  # the server's parent
    assert by_name["proxy.prefill"].attributes["http.status_code"] == 200
    assert by_name["proxy.decode"].end_time <= request.end_time


def test_without_a_traceparent_the_proxy_starts_a_trace_and_a_failed_call_says_why(exported) -> None:
    with fake("decode") as d, vanishing() as p, proxy_in_front([p.url], [d.url], max_retries=0) as url:
        p.vanish()  # since the proxy's probe at start
        response = http_client().post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert response.status_code == 503  # the one P cannot be reached
    spans = {s.name: s for s in exported.get_finished_spans()}
    assert spans["proxy.request"].parent is None and spans["proxy.request"].attributes["http.status_code"] == 503
    assert spans["proxy.prefill"].attributes["error.type"] == "ConnectError"
    assert "proxy.decode" not in spans and not d.received
