"""Traces across proxy -> P -> D with OpenTelemetry (`--otlp-traces-endpoint URL`).

Off by default, and then nothing of OpenTelemetry is imported: callers ask `enabled()`
before anything else. On, the process exports its spans over OTLP/HTTP (protobuf) in
batches, as service `service` (`pd-proxy`, `pd-serve`); the installed extra
`pd-serve[tracing]` brings the SDK and the exporter.

A request's trace crosses processes in W3C `traceparent` headers: the proxy continues the
client's (or starts one), and passes each server the context of the span that calls it;
a server's request span continues that. Spans are the SDK's own objects; callers only
`set_attribute`, `end` and pass them back here. Times are wall-clock (`time.time()`)
seconds where a caller gives them: what the engine process measured can become a child
span afterwards (`child`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from wire.headers import TRACE_HEADERS

SERVER, CLIENT, INTERNAL = "server", "client", "internal"
_tracer: Any = None
_provider: Any = None


def enabled() -> bool:
    return _tracer is not None


def configure(service: str, endpoint: str | None = None, exporter: Any = None,
              attributes: Mapping[str, str] | None = None) -> None:
    """Export this process's spans to `endpoint` (OTLP/HTTP, e.g.
    http://127.0.0.1:4318/v1/traces), or to `exporter` (an SDK span exporter, each span as
    it ends: tests); neither: tracing stays off. `attributes` describe the process (its
    role, its address) on every span. ImportError, with what to install, without the SDK;
    ValueError for an endpoint that is not an http(s) URL."""
    global _tracer, _provider
    if endpoint is None and exporter is None:
        return
    if endpoint is not None and not endpoint.startswith(("http://", "https://")):
        raise ValueError(f"the OTLP traces endpoint must be an http:// or https:// URL (OTLP/HTTP, e.g. "
                         f"http://127.0.0.1:4318/v1/traces), got {endpoint!r}")
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError as exc:
        raise ImportError(f"tracing needs OpenTelemetry: pip install 'pd-serve[tracing]' ({exc})") from None
    provider = TracerProvider(resource=Resource.create({"service.name": service, **(attributes or {})}))
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    _provider, _tracer = provider, provider.get_tracer("pd")


def shutdown() -> None:
    """Export what is still queued and turn tracing off (idempotent)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def start(name: str, parent: Any = None, headers: Mapping[str, str] | None = None, kind: str = INTERNAL,
          attributes: Mapping[str, Any] | None = None, start_s: float | None = None) -> Any:
    """A started span: the child of span `parent`, else of the `traceparent` in
    `headers` (a new trace without one), named `name`."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if parent is not None:
        context = trace.set_span_in_context(parent)
    else:
        context = TraceContextTextMapPropagator().extract(_lower(headers or {}))
    return _tracer.start_span(name, context=context, kind=_kind(kind), attributes=_clean(attributes),
                              start_time=None if start_s is None else int(start_s * 1e9))


def child(parent: Any, name: str, start_s: float, end_s: float, attributes: Mapping[str, Any] | None = None) -> None:
    """A finished child span of `parent` from `start_s` to `end_s` (what was measured
    elsewhere: the engine's queue, prefill, KV read and decode)."""
    span = start(name, parent=parent, attributes=attributes, start_s=start_s)
    span.end(end_time=int(max(end_s, start_s) * 1e9))


def headers_for(span: Any) -> dict[str, str]:
    """The `traceparent` (and `tracestate`) that make the receiver's spans `span`'s children."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def trace_id(span: Any) -> str:
    """`span`'s trace id as 32 hex digits (as log lines name it)."""
    return format(span.get_span_context().trace_id, "032x")


def _kind(kind: str) -> Any:
    from opentelemetry.trace import SpanKind

    return {SERVER: SpanKind.SERVER, CLIENT: SpanKind.CLIENT, INTERNAL: SpanKind.INTERNAL}[kind]


def _lower(headers: Mapping[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items() if k.lower() in TRACE_HEADERS}


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    """Attributes OpenTelemetry takes: None values dropped."""
    return {k: v for k, v in (attributes or {}).items() if v is not None}
