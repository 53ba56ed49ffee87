"""One request through `pd proxy` to a real prefill and decode server (NIXL between them),
each exporting its spans over OTLP/HTTP to a receiver started here: one trace whose spans
cover the proxy, P, the KV read and D, with their parent links; and JSON log lines that
name the request and its trace."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                       ExportTraceServiceResponse)

from launch import http_client
from tests.support.server_harness import running_proxy, running_server, wait_until

pytestmark = pytest.mark.slow
MODEL = "qwen3"
PROMPT = "A lighthouse keeper wrote down every ship that passed the rocks. " * 3


@dataclass(frozen=True)
class Received:
    service: str
    role: str | None
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict


@contextlib.contextmanager
def otlp_receiver() -> Iterator[tuple[str, list[Received]]]:
    """An OTLP/HTTP trace receiver on 127.0.0.1: its URL and the spans it got."""
    spans: list[Received] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (the standard library's name)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            export = ExportTraceServiceRequest.FromString(body)
            for resource in export.resource_spans:
                labels = {a.key: a.value.string_value for a in resource.resource.attributes}
                for scope in resource.scope_spans:
                    spans.extend(Received(labels["service.name"], labels.get("pd.role"), s.name, s.trace_id.hex(),
                                          s.span_id.hex(), s.parent_span_id.hex(),
                                          {a.key: _value(a.value) for a in s.attributes}) for s in scope.spans)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", spans
    finally:
        server.shutdown()
        server.server_close()


def _value(value):
    kind = value.WhichOneof("value")
    return list(getattr(value, kind).values) if kind == "array_value" else getattr(value, kind)


def test_a_pd_request_is_one_trace_across_proxy_p_the_transfer_and_d(tiny_models, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # the servers export within 50 ms of a span's end
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    model = tiny_models[MODEL]
    with otlp_receiver() as (endpoint, spans), contextlib.ExitStack() as stack:
        traced = ("--otlp-traces-endpoint", endpoint, "--log-format", "json")
        p = stack.enter_context(running_server(model, tmp_path / "p.log", "--role", "prefill", *traced))
        d = stack.enter_context(running_server(model, tmp_path / "d.log", "--role", "decode", *traced))
        proxy = stack.enter_context(running_proxy(tmp_path / "proxy.log", "--prefill", p.url, "--decode", d.url,
                                                  *traced))
        response = http_client().post(f"{proxy.url}/v1/completions", headers={"X-Request-Id": "traced-live"},
                                      json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0}, timeout=120)
        assert response.status_code == 200 and response.headers["x-pd-path"] == "disaggregated"
        names = {"proxy.request", "proxy.prefill", "proxy.decode", "pd.request", "pd.kv_read", "pd.decode"}
        assert wait_until(lambda: names <= {s.name for s in spans}, 30), sorted({s.name for s in spans})
    (root,) = [s for s in spans if s.name == "proxy.request"]
    trace = [s for s in spans if s.trace_id == root.trace_id]
    assert len(trace) == len(spans)  # nothing else was sent: every span is this request's
    one = {(s.service, s.role, s.name): s for s in trace}
    proxy_prefill, proxy_decode = one["pd-proxy", None, "proxy.prefill"], one["pd-proxy", None, "proxy.decode"]
    assert root.parent_id == "" and root.attributes["pd.request_id"] == "traced-live"
    assert proxy_prefill.parent_id == root.span_id and proxy_decode.parent_id == root.span_id
    on_p, on_d = one["pd-serve", "prefill", "pd.request"], one["pd-serve", "decode", "pd.request"]
    assert on_p.parent_id == proxy_prefill.span_id and on_d.parent_id == proxy_decode.span_id
    assert {s.name for s in trace if s.parent_id == on_p.span_id} == {"pd.queue", "pd.prefill"}
    assert {s.name for s in trace if s.parent_id == on_d.span_id} == {"pd.queue", "pd.kv_read", "pd.decode"}
    assert one["pd-serve", "decode", "pd.kv_read"].attributes["pd.kv_tokens"] > 0  # the transfer: P's blocks read
    assert on_d.attributes["pd.output_tokens"] == 6 and on_d.attributes["pd.request_id"] == "traced-live"
    lines = [json.loads(line) for line in (tmp_path / "d.log").read_text().splitlines() if line.startswith("{")]
    named = [line for line in lines if line.get("request_id") == "traced-live"]
    assert named and all(line["trace_id"] == root.trace_id for line in named)
