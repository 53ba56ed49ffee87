"""The last requests the proxy answered, for the dashboard (`dashboard.py`): a ring of
`RECENT_REQUESTS` records, the oldest dropped as a new one comes. Each is written on
the request path, so nothing here raises on what a response carries: a header that does
not parse leaves its figure unknown (None)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response, StreamingResponse

from wire.headers import PD_DECODE, PD_PATH, PD_PREFILL, REQUEST_ID

RECENT_REQUESTS = 50


@dataclass
class RequestRecord:
    """One client request: where it went (`X-PD-Path`, and the P and D that the
    X-PD-Prefill / X-PD-Decode headers name; each decode server it was migrated to after,
    `migrated`) and its timings in ms: to the first chunk
    of a streamed answer (`ttft_ms`; None unstreamed) and to the end (`total_ms`; None
    while it is in flight). `on_answered(ttft_s, total_s)` is told of a request answered
    200 whole (a stream sent to its end), for the proxy's latency histograms."""

    endpoint: str
    started_at: float = field(default_factory=time.time)  # wall clock, for display
    request_id: str | None = None
    status: int | None = None
    path: str | None = None
    prefill: str | None = None
    decode: str | None = None
    ttft_ms: float | None = None
    total_ms: float | None = None
    migrations: list[str] = field(default_factory=list)  # each move to another decode server (migration.py)
    _t0: float = field(default_factory=time.monotonic, repr=False)
    on_answered: Callable[[float | None, float], None] | None = field(default=None, repr=False)

    def _elapsed_ms(self) -> float:
        return round((time.monotonic() - self._t0) * 1000, 1)

    def answered(self, response: Response, prefill: Sequence[str], decode: Sequence[str]) -> Response:
        """Note the response's status and route; a streamed one is timed as it is sent
        (its body wrapped), any other ends now."""
        self.status = response.status_code
        self.request_id = response.headers.get(REQUEST_ID)
        self.path = response.headers.get(PD_PATH)
        self.prefill = _picked(response.headers.get(PD_PREFILL), prefill)
        self.decode = _picked(response.headers.get(PD_DECODE), decode)
        if isinstance(response, StreamingResponse):
            response.body_iterator = self._timed(response.body_iterator)
        else:
            self._ended(whole=True)
        return response

    def failed(self) -> None:
        """The proxy failed answering (its 500)."""
        self.status, self.total_ms = 500, self._elapsed_ms()

    async def _timed(self, chunks: AsyncIterator[Any]) -> AsyncIterator[Any]:
        whole = False
        try:
            async for chunk in chunks:
                if self.ttft_ms is None:
                    self.ttft_ms = self._elapsed_ms()
                yield chunk
            whole = True
        finally:  # the end, or the client left
            self._ended(whole)

    def _ended(self, whole: bool) -> None:
        self.total_ms = self._elapsed_ms()
        if whole and self.status == 200 and self.on_answered is not None:
            self.on_answered(None if self.ttft_ms is None else self.ttft_ms / 1000, self.total_ms / 1000)

    def as_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "endpoint": self.endpoint, "started_at": self.started_at,
                "status": self.status, "path": self.path, "prefill": self.prefill, "decode": self.decode,
                "ttft_ms": self.ttft_ms, "total_ms": self.total_ms, "migrations": list(self.migrations)}

    def migrated(self, outcome: str, url: str) -> None:
        """The request was taken to the decode server at `url` (resumed or replayed)."""
        self.migrations.append(f"{outcome} on {url}")


def _picked(header: str | None, urls: Sequence[str]) -> str | None:
    """The URL an X-PD-Prefill / X-PD-Decode header ("INDEX; overlap=N") names."""
    index = (header or "").partition(";")[0].strip()
    if not (index.isascii() and index.isdigit() and len(index) < 10):  # "²".isdigit() too
        return None
    return urls[int(index)] if int(index) < len(urls) else None


class RecentRequests:
    def __init__(self, size: int = RECENT_REQUESTS) -> None:
        self._ring: deque[RequestRecord] = deque(maxlen=size)

    def start(self, endpoint: str, on_answered: Callable[[float | None, float], None] | None = None) -> RequestRecord:
        record = RequestRecord(endpoint, on_answered=on_answered)
        self._ring.append(record)
        return record

    def newest_first(self) -> list[dict[str, Any]]:
        return [record.as_dict() for record in reversed(self._ring)]
