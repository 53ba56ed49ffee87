"""What httpcore's trace reports of one request's connection (the `trace` extension):
whether the request went out on a connection the pool kept from an earlier request, and
whether the connection ended before any response came back. Both together are the
keep-alive race: the server closed the idle connection (it was stopping, say) as the
request was written, so the request never reached it and can go to another server. A
response that did not come in time is not that: the server had the request (and a
request that hangs its server must not be tried on another; the proxy's probes made
such a kept-alive connection the first request's)."""

from __future__ import annotations

from typing import Any

import httpcore


class ConnectionTrace:
    """Pass as `extensions={"trace": ConnectionTrace()}`; read `stale` after a failure."""

    def __init__(self) -> None:
        self.connected = False  # a new TCP connection was opened for this request
        self.unanswered = False  # the connection ended as the response's head was read

    async def __call__(self, name: str, info: dict[str, Any]) -> None:
        if name == "connection.connect_tcp.started":
            self.connected = True
        elif name in ("http11.receive_response_headers.failed", "http2.receive_response_headers.failed"):
            self.unanswered = not isinstance(info.get("exception"), httpcore.TimeoutException)

    @property
    def stale(self) -> bool:
        """The request failed unanswered on a kept-alive connection."""
        return self.unanswered and not self.connected
