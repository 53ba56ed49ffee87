"""A request's spans in the proxy (`telemetry.tracing`, when `--otlp-traces-endpoint` is
given; otherwise only its id is bound to the log lines written for it).

`proxy.request` (kind server) continues the client's `traceparent` or starts a trace, and
ends when the answer does: a stream when its last byte is sent or the client leaves. Its
children: a `proxy.route` span for each pick (role, policy, the instance chosen and what
every candidate looked like: requests in flight, prompt tokens held), and a client span
for each call to a server, `proxy.prefill` or `proxy.decode`, whose context is the
`traceparent` that server continues. A decode span lasts until D's answer is closed.
"""

from __future__ import annotations

from typing import Any

from proxy.calls import Call
from proxy.instances import Instance, InstancePool
from telemetry import logs, tracing
from wire.headers import PD_PATH


def begin(call: Call, headers: Any) -> None:
    """Start `call`'s request span from the client's `headers`; bind its ids to the logs."""
    if not tracing.enabled():
        logs.bind(call.request_id)
        return
    call.span = tracing.start("proxy.request", headers=headers, kind=tracing.SERVER, attributes={
        "pd.request_id": call.request_id, "http.route": call.endpoint, "pd.stream": call.stream})
    logs.bind(call.request_id, tracing.trace_id(call.span))


def end(call: Call, status: int | None, path: str | None = None) -> None:
    """End `call`'s request span with the client's status (idempotent)."""
    span, call.span = call.span, None
    if span is not None:
        span.set_attributes({k: v for k, v in {"http.status_code": status, "pd.path": path}.items() if v is not None})
        span.end()


def answered(call: Call, response: Any) -> None:
    """End `call`'s request span with the answer the client got (None: an exception)."""
    end(call, getattr(response, "status_code", None),
        None if response is None else response.headers.get(PD_PATH))


def routed(call: Call, pool: InstancePool, chosen: Instance) -> None:
    """A `proxy.route` span: `pool`'s pick of `chosen` for `call`."""
    if call.span is None:
        return
    candidates = [f"{i.url} in_flight={i.in_flight} held_tokens={i.overlap_tokens(call.route)} "
                  f"breaker={'closed' if i.breaker.allows() else 'open'}" for i in pool.instances]
    span = tracing.start("proxy.route", parent=call.span, attributes={
        "pd.role": pool.role, "pd.policy": pool.policy, "pd.instance": chosen.url,
        "pd.held_tokens": chosen.overlap_tokens(call.route), "pd.candidates": candidates})
    span.end()


def calling(call: Call, instance: Instance) -> tuple[Any, dict[str, str]]:
    """The client span of a call to `instance` (None with tracing off) and the headers that
    carry its context there."""
    if call.span is None:
        return None, call.headers
    span = tracing.start(f"proxy.{instance.role}", parent=call.span, kind=tracing.CLIENT,
                         attributes={"pd.instance": instance.url, "pd.role": instance.role})
    return span, call.headers | tracing.headers_for(span)


def called(span: Any, status: int | None = None, error: str | None = None) -> None:
    """End a call's span with the server's status, or what failed it."""
    if span is None:
        return
    if status is not None:
        span.set_attribute("http.status_code", status)
    if error is not None:
        span.set_attribute("error.type", error)
    span.end()
