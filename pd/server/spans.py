"""A request's spans on this server (`telemetry.tracing`, with `--otlp-traces-endpoint`).

`pd.request` (kind server) continues the caller's `traceparent` (the proxy's prefill or
decode call) and ends with the response, a stream when it ends or its client leaves.
When the engine's finishing output came, its `RequestTimes` become the children, with the
engine's own clock: `pd.queue` (arrival to its first step, or to waiting for remote KV),
`pd.kv_read` (waiting for the remote KV of `pd.kv_tokens` tokens until it landed: the
transfer from P, its bytes and descriptors), `pd.prefill` (its first step to its first
token) and `pd.decode` (the first token to the end). A span is made of what happened: D under remote prefill has no
prefill of its own, P no decode.
"""

from __future__ import annotations

from typing import Any

from pd.contracts.request import RequestTimes, cached_tokens
from telemetry import tracing


class RequestSpan:
    """The span of one request: started when it is prepared, `finish`ed once."""

    def __init__(self, headers: Any, request_id: str, role: str, prompt_tokens: int) -> None:
        self.span = tracing.start("pd.request", headers=headers, kind=tracing.SERVER, attributes={
            "pd.request_id": request_id, "pd.role": role, "pd.prompt_tokens": prompt_tokens})
        self.trace_id = tracing.trace_id(self.span)
        self.finished = False

    def finish(self, times: RequestTimes | None, output_tokens: int, prompt_sources: dict[str, int],
               finish_reason: str | None) -> None:
        """End the span (idempotent), with the engine's `times` as children if it sent them,
        and where the prompt's KV came from (`pd.prompt_tokens.<source>`, and their sum
        but the computed ones as `pd.cached_tokens`: the client's usage says the same)."""
        if self.finished:
            return
        self.finished = True
        if times is not None:
            for name, start, end, attributes in phases(times, output_tokens):
                tracing.child(self.span, name, start, end, attributes)
            if times.kv_error is not None:  # its KV could not be loaded (a digest mismatch among the reasons)
                self.span.add_event("pd.kv_load_failed", {"pd.kv_error": times.kv_error})
        self.span.set_attributes({"pd.output_tokens": output_tokens, "pd.cached_tokens": cached_tokens(prompt_sources),
                                  "pd.finish_reason": finish_reason or "none",
                                  **{f"pd.prompt_tokens.{source}": n for source, n in prompt_sources.items()}})
        self.span.end()


def phases(times: RequestTimes, output_tokens: int) -> list[tuple[str, float, float, dict[str, Any]]]:
    """(name, start, end, attributes) of each phase `times` show, in order (a decode only
    past one output token: P's single token is its prefill's)."""
    out: list[tuple[str, float, float, dict[str, Any]]] = []
    end = times.finished or times.first_token or times.scheduled or times.arrival
    queued_until = min(t for t in (times.kv_wait, times.scheduled, end) if t is not None)
    out.append(("pd.queue", times.arrival, queued_until, {}))
    if times.kv_wait is not None and times.kv_landed is not None:
        read = {"pd.kv_tokens": times.kv_tokens, "pd.kv_bytes": times.kv_bytes,
                "pd.kv_descriptors": times.kv_descriptors}
        out.append(("pd.kv_read", times.kv_wait, times.kv_landed,
                    read if times.kv_error is None else read | {"pd.kv_error": times.kv_error}))
    if times.scheduled is not None and times.first_token is not None and times.first_token >= times.scheduled:
        out.append(("pd.prefill", times.scheduled, times.first_token, {}))
    if times.first_token is not None and times.finished is not None and output_tokens > 1:
        out.append(("pd.decode", max(times.first_token, times.scheduled or times.first_token), times.finished, {}))
    return out
