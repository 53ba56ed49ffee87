"""An OTLP/HTTP trace receiver on 127.0.0.1 for tests: servers started with
`--otlp-traces-endpoint` export their spans to it, decoded here with OpenTelemetry's
protobuf messages."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class Received:
    service: str
    role: str | None
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict
    events: tuple[str, ...] = ()  # the names of its events


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
                                          {a.key: _value(a.value) for a in s.attributes},
                                          tuple(e.name for e in s.events)) for s in scope.spans)
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
