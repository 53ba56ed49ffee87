"""What the proxy sends on and gets back: a client request as sent to the servers
(`Call`), and the outcomes of its prefill and decode calls (`upstream.py`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi.responses import Response

from proxy.instances import Instance, InstancePool, Route
from wire.headers import PD_DECODE, PD_PREFILL

ROUTE_HEADERS = {"prefill": PD_PREFILL, "decode": PD_DECODE}  # the instance picked for each role


@dataclass
class Call:
    """One client request as the proxy sends it on: the same endpoint, body, headers
    (X-Request-Id and Authorization) to P and D; `route` is what picking looks at.
    `picked` names, per role, the instance chosen and the prompt tokens it was expected
    to hold (answered in the X-PD-Prefill / X-PD-Decode headers). `bound`: the decode
    server picked before prefill, which counts the request in flight until it is
    opened there (or the call ends)."""

    endpoint: str
    body: dict[str, Any]
    headers: dict[str, str]
    route: Route
    request_id: str
    picked: dict[str, tuple[int, int]] = field(default_factory=dict)
    bound: Instance | None = None
    prefix: dict[str, Any] | None = None  # a decode server's parameters for a prefix P reads (reuse.py)
    tap: Any = None  # its Tap (tap.py), for the canary or a migration: D is asked for the token ids
    canary: bool = False  # its answer is run again colocated once whole (canary.py)
    span: Any = None  # its request span, with tracing on (spans.py)
    record: Any = None  # its record in the dashboard's recent requests (recent.py), if kept

    def bind(self, instance: Instance) -> None:
        self.bound = instance
        instance.bound += 1

    def unbind(self) -> None:
        """Idempotent."""
        if self.bound is not None:
            self.bound.bound -= 1
            self.bound = None

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True

    def work_tokens(self, instance: Instance) -> int:
        """The prompt tokens `instance` has to work through for it (compute on P, pull
        on D): those it does not hold already (0 when the prompt is not known)."""
        return instance.lacking_tokens(self.route) or 0

    def note_pick(self, pool: InstancePool, instance: Instance) -> None:
        held = instance.overlap_tokens(self.route)
        # its place in the pool now (-1: it left the pool meanwhile; the fleet changes at runtime)
        index = next((k for k, member in enumerate(pool.instances) if member is instance), -1)
        self.picked[pool.role] = (index, held)

    def route_headers(self) -> dict[str, str]:
        return {ROUTE_HEADERS[role]: f"{index}; overlap={held}" for role, (index, held) in self.picked.items()}


@dataclass(frozen=True)
class Prefilled:
    """P's answer: the instance that holds the request's blocks, and its kv_transfer_params;
    `reused`: P read a prefix from the decode server (reuse.py)."""

    instance: Instance
    params: dict[str, Any]
    reused: bool = False


@dataclass
class Opened:
    """D's 200 response, headers read and body not yet; its instance counts it (and the
    prompt tokens it works through for it) outstanding until `close` (idempotent)."""

    instance: Instance
    response: httpx.Response
    work_tokens: int = 0
    on_close: Callable[[], None] = lambda: None
    span: Any = None  # the decode call's span, with tracing on: ends with the answer
    closed: bool = field(default=False, repr=False)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.span is not None:
            self.span.end()
        self.instance.outstanding -= 1
        self.instance.outstanding_tokens -= self.work_tokens
        self.on_close()
        await self.response.aclose()


@dataclass(frozen=True)
class NoRoom:
    """No server can take the request now (every P full or holding too much): it may
    wait in the queue (admission.py); `answer` is what the client gets if it does not."""

    answer: Response
    retry_after_s: float | None = None
    overloaded: str | None = None  # the role whose every instance is at --max-outstanding


@dataclass(frozen=True)
class Unreached:
    """No prefill server took the request (none healthy, or none could be reached or
    had a live engine): nothing was computed for it. `answer` is the client's 503,
    unless the decode server prefills the request itself (`disagg.py`)."""

    answer: Response


@dataclass(frozen=True)
class TryAnother:
    """This server did not take the request and another may: a P's `retry_after_s` when
    it refused for the KV it holds; otherwise it could not be reached, a P's engine was
    dead, or (`stale`) the request was written on a kept-alive connection that closed
    unanswered (each a failure counted against its breaker)."""

    retry_after_s: float | None = None
    stale: bool = False  # a kept-alive connection closed unanswered


@dataclass(frozen=True)
class Broke:
    """A decode server failed the request before the client got anything of its answer
    (`reason`: migration.REASONS); `answer` is what the client gets unless the request is
    taken to another (migration.py)."""

    instance: Instance
    reason: str
    answer: Response
