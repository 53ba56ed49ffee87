"""Spans across processes in W3C traceparent headers (the SDK's in-memory exporter), and
nothing of OpenTelemetry imported while tracing is off."""

from __future__ import annotations

import subprocess
import sys

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from telemetry import tracing


@pytest.fixture
def exported():
    exporter = InMemorySpanExporter()
    tracing.configure("pd-test", exporter=exporter, attributes={"pd.role": "decode"})
    try:
        yield exporter
    finally:
        tracing.shutdown()


def test_off_unless_an_endpoint_or_exporter_is_given() -> None:
    tracing.configure("pd-test", None)
    assert not tracing.enabled()


def test_a_span_continues_the_traceparent_another_span_sent(exported) -> None:
    root = tracing.start("proxy.request", headers={"x-other": "1"}, kind=tracing.SERVER)  # no traceparent: a new trace
    headers = tracing.headers_for(root)
    assert headers["traceparent"].split("-")[1] == tracing.trace_id(root)
    remote = tracing.start("pd.request", headers={"TraceParent": headers["traceparent"]}, kind=tracing.SERVER,
                           attributes={"pd.request_id": "cmpl-1", "pd.none": None})
    tracing.child(remote, "pd.queue", 100.0, 100.5, {"pd.kv_tokens": 3})
    remote.end()
    root.end()
    spans = {s.name: s for s in exported.get_finished_spans()}
    assert spans["pd.request"].context.trace_id == spans["proxy.request"].context.trace_id
    assert spans["pd.request"].parent.span_id == spans["proxy.request"].context.span_id
    assert spans["pd.queue"].parent.span_id == spans["pd.request"].context.span_id
    assert (spans["pd.queue"].start_time, spans["pd.queue"].end_time) == (100_000_000_000, 100_500_000_000)
    assert dict(spans["pd.request"].attributes) == {"pd.request_id": "cmpl-1"}  # None dropped
    assert spans["pd.request"].resource.attributes["service.name"] == "pd-test"
    assert spans["pd.request"].resource.attributes["pd.role"] == "decode"


@pytest.mark.parametrize("traceparent", ["garbage", "00-" + "0" * 32 + "-" + "1" * 16 + "-01", "00-zz", "x" * 5000])
def test_a_malformed_traceparent_starts_a_new_trace(exported, traceparent) -> None:
    span = tracing.start("proxy.request", headers={"traceparent": traceparent})
    span.end()
    (finished,) = exported.get_finished_spans()
    assert finished.parent is None and finished.context.trace_id != 0


def test_a_child_never_ends_before_it_starts(exported) -> None:
    parent = tracing.start("pd.request")
    tracing.child(parent, "pd.decode", 10.0, 9.0)
    (child,) = exported.get_finished_spans()
    assert child.end_time == child.start_time


def test_with_tracing_off_the_request_paths_import_no_opentelemetry() -> None:
    """Requests through the proxy to (fake) servers in a fresh interpreter with the
    server's and the proxy's modules loaded: no OpenTelemetry module is imported on the
    request path, and the SDK never. (FastAPI imports the OpenTelemetry API itself when it
    is imported; its own instrumentation stays off without a global tracer provider.)"""
    script = """
import sys
from launch import http_client
import pd.server.main, pd.server.app, proxy.main
from tests.support.proxy_fakes import fake, proxy_in_front
loaded = {m for m in sys.modules if m.startswith("opentelemetry")}
with fake("prefill") as p, fake("decode") as d, proxy_in_front([p.url], [d.url]) as url:
    for stream in (False, True):
        r = http_client().post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": stream})
        assert r.status_code == 200, r.text
print(sorted(m for m in sys.modules if m.startswith("opentelemetry") and m not in loaded))
print(sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-2:] == ["[]", "[]"]


@pytest.mark.parametrize("endpoint", ["127.0.0.1:4318", "grpc://127.0.0.1:4317", ""])
def test_an_endpoint_that_is_not_an_http_url_is_refused_at_start(endpoint) -> None:
    with pytest.raises(ValueError, match="http:// or https://"):
        tracing.configure("pd-test", endpoint)
    assert not tracing.enabled()
    result = subprocess.run([sys.executable, "-m", "cli.main", "proxy", "--prefill", "http://127.0.0.1:9",
                             "--decode", "http://127.0.0.1:10", "--otlp-traces-endpoint", endpoint],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "pd proxy: the OTLP traces endpoint must be an http://" in result.stderr
