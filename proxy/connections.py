"""What httpcore's trace reports of one request's connection (the `trace` extension):
whether the request went out on a connection the pool kept from an earlier request, and
whether it failed before any response came back. Both together are the keep-alive race:
the server closed the idle connection (it was stopping, say) as the request was written,
so the request never reached it and can go to another server."""

from __future__ import annotations

from typing import Any


class ConnectionTrace:
    """Pass as `extensions={"trace": ConnectionTrace()}`; read `stale` after a failure."""

    def __init__(self) -> None:
        self.connected = False  # a new TCP connection was opened for this request
        self.unanswered = False  # reading the response's head failed: no response came

    async def __call__(self, name: str, info: dict[str, Any]) -> None:
        if name == "connection.connect_tcp.started":
            self.connected = True
        elif name in ("http11.receive_response_headers.failed", "http2.receive_response_headers.failed"):
            self.unanswered = True

    @property
    def stale(self) -> bool:
        """The request failed unanswered on a kept-alive connection."""
        return self.unanswered and not self.connected
