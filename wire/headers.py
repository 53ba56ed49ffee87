"""Header names both sides of the proxy <-> server hop read or write. HTTP header names
are case-insensitive, and so are the header maps of starlette and httpx: these spellings
are what is sent."""

from __future__ import annotations

import math

REQUEST_ID = "X-Request-Id"  # the request's id: the client's, else the proxy's, else the server's own
RETRY_AFTER = "Retry-After"  # seconds to wait before trying again (429, 503)
PD_PATH = "X-PD-Path"  # the proxy's answer: the path a request took (pd, colocated, ...)
PD_PREFILL = "X-PD-Prefill"  # the proxy's answer: the prefill server it used
PD_DECODE = "X-PD-Decode"  # the proxy's answer: the decode server it used
PD_MIGRATABLE = "X-PD-Migratable"  # "1", proxy -> D: the proxy takes this stream elsewhere if D drains
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context, passed from the proxy to the servers


def retry_after(seconds: float) -> dict[str, str]:
    """The Retry-After header for a wait of `seconds` (whole seconds, rounded up)."""
    return {RETRY_AFTER: str(math.ceil(max(0.0, seconds)))}
