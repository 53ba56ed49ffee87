"""Requests outlive their decode servers (`--migration-limit N`, default 3): when D fails
midway, the proxy takes the request to another decode server and the client's answer
goes on as if nothing had happened.

D has failed when its connection breaks or times out (`httpx.TransportError`: a killed
server, a reset, a peer silent past `--decode-timeout`), it says its engine died
(`engine_died`: a 500, or an error event in its stream), or it left the fleet while its
stream was silent (`gone`: a registered server whose lease ended without a renewal, or
any server whose breaker opened, its /health probes failing: cut off or frozen with its
connection open; looked at every WATCH_S of silence). Then:

- nothing of the answer reached the client yet (an unstreamed request, or a stream
  before its first event): the request is **replayed**, its body sent whole to another D
  without P's `kv_transfer_params` (D computes the prompt; P is asked to free its blocks,
  which the failed D may or may not have read). Greedy and seeded requests answer the
  same tokens; a seeded draw is addressed by its position (pd/worker/sampler.py).
- a stream the client has been reading: it is **resumed** (unless tool calls are read
  from it): the new D gets the body with `resume` — for each choice, the token ids the
  client got (D is asked for them, `Tap`, and they are taken out again unless the client
  asked), the characters of text it was sent, and its finish reason if it had ended — and
  runs each choice left as a sequence of its own: it computes the prompt and those
  tokens, then goes on at the next one: its penalties count them, its grammar has
  advanced over them, a stop string may straddle the seam, a seeded choice draws as its
  sequence would (seed + its index), and `usage` counts them as output
  (pd/server/resume.py, `Resumed`). Its chunks carry the first server's `id` and
  `created`; nothing is repeated or missing.

A draining decode server hands on the streams the proxy can resume (it sends them
`X-PD-Migratable`): each ends with a `migrated` error event that names, per choice, the
`kv_transfer_params` of its KV kept there (the prompt and every token but the last,
under a lease). The stream is resumed as above, each choice carrying its parameters
(reason `drain`, outcome `moved`): the new D reads that KV and computes nothing again.
Where it refuses them (a 400 or 403: expired, say), they are released and the stream is
resumed from its tokens alone.

A request is migrated at most `--migration-limit` times; one that cannot be (the limit,
no decode server left, a stream read for tool calls) ends as
before: an error event in a stream, a 502 otherwise. Each migration is counted
(`pd_proxy_migrations_total{reason,outcome}`), with the tokens replayed and the time the
stream stood still, and is a `proxy.migrate` span in the request's trace.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi.responses import Response

from proxy.calls import Broke, Call, Opened, Prefilled
from proxy.instances import Instance, NoInstanceError, OverloadedError
from proxy.tap import Tap
from telemetry import tracing
from wire.codes import ENGINE_DIED, MIGRATED
from wire.kv_params import KV_TRANSFER_PARAMS

logger = logging.getLogger(__name__)

DRAIN = "drain"
REASONS = ("connection", ENGINE_DIED, "gone", DRAIN)
OUTCOMES = ("moved", "resumed", "replayed", "failed")
WATCH_S = 1.0  # a stream silent this long is looked at: is its decode server still in the fleet?


class Gone(Exception):
    """The decode server of a stream left the fleet while the stream waited on it."""


def resumable(body: dict[str, Any]) -> bool:
    """Whether a stream of this body can be resumed midway: no tool calls read from it."""
    return not body.get("tools")


def failure(exc: BaseException | None = None, error: dict[str, Any] | None = None) -> str | None:
    """The reason D failed (REASONS) for an exception reading its answer, or an error
    event it sent; None for one that is the request's own (not migrated)."""
    if isinstance(exc, httpx.TransportError):
        return "connection"
    if isinstance(exc, Gone):
        return "gone"
    if error is not None and error.get("code") == ENGINE_DIED:
        return ENGINE_DIED
    if error is not None and error.get("code") == MIGRATED:
        return DRAIN
    return None


@dataclass
class HandedOn:
    """A draining decode server's hand-over of a stream: per choice, the parameters of the
    KV it keeps for the next one (None: nothing kept)."""

    holder: Instance
    params: list[dict[str, Any] | None]

    @classmethod
    def of(cls, holder: Instance, error: dict[str, Any]) -> HandedOn:
        params = error.get(KV_TRANSFER_PARAMS)
        params = params if isinstance(params, list) else []
        return cls(holder, [p if isinstance(p, dict) and isinstance(p.get("num_prompt_tokens"), int) else None
                            for p in params])

    def choice(self, index: int) -> dict[str, Any] | None:
        return self.params[index] if index < len(self.params) else None


@dataclass
class Migration:
    """A request's migrations so far: the decode servers that failed it, how many times."""

    limit: int
    failed: set[str] = field(default_factory=set)
    count: int = 0
    broke_at: float | None = None  # when the stream last broke (monotonic): its pause runs from there
    handed: HandedOn | None = None  # the KV its last decode server handed it on with, not yet read

    def allows(self) -> bool:
        return self.count < self.limit

    def body(self, call: Call, tap: Tap | None) -> tuple[dict[str, Any], str]:
        """The body for the next decode server, and the outcome it makes (moved, resumed
        or replayed): the client's, less P's parameters, with `resume` once the client has
        read some of the stream, each choice with the KV it was handed on with, if any."""
        body = {k: v for k, v in call.body.items() if k != KV_TRANSFER_PARAMS}
        if tap is None or not tap.events:
            return body, "replayed"
        n = body.get("n") if isinstance(body.get("n"), int) else 1
        choices = []
        for j in range(n):
            c = tap.choice(j)
            choice = {"token_ids": list(c.token_ids), "text_chars": c.text_chars, "finish_reason": c.finish_reason}
            kv = self.handed.choice(j) if self.handed is not None and c.finish_reason is None else None
            choices.append(choice | ({KV_TRANSFER_PARAMS: kv} if kv is not None else {}))
        moved = any(KV_TRANSFER_PARAMS in c for c in choices)
        return body | {"return_token_ids": True, "resume": {"choices": choices}}, "moved" if moved else "resumed"

    async def release(self, upstream: Any, call: Call) -> None:
        """Free now the KV a draining server keeps for this stream: no server will read it."""
        handed, self.handed = self.handed, None
        if handed is not None:
            await asyncio.gather(*(upstream.release(Prefilled(handed.holder, params), call.headers)
                                   for params in handed.params if params is not None))


def span(call: Call, instance: Instance, reason: str, tokens: int) -> Any:
    """A `proxy.migrate` span under the request's (None with tracing off)."""
    if call.span is None:
        return None
    return tracing.start("proxy.migrate", parent=call.span, attributes={
        "pd.instance": instance.url, "pd.migrate.reason": reason, "pd.migrate.tokens": tokens})


def paused(migration: Migration) -> float | None:
    """Seconds the stream stood still, at the first bytes after a migration."""
    if migration.broke_at is None:
        return None
    seconds, migration.broke_at = time.monotonic() - migration.broke_at, None
    return seconds


async def reopen(upstream: Any, call: Call, tap: Tap | None, migration: Migration, instance: Instance, reason: str,
                 answer: Response) -> Opened | Response:
    """The request opened on another decode server after `instance` failed it for
    `reason` (and any it is then taken to fails likewise); `answer` (what the client gets)
    when it cannot be: the limit reached, or no decode server left to take it."""
    metrics = upstream.metrics
    while True:
        migration.failed.add(instance.url)
        body, outcome = migration.body(call, tap)
        if not migration.allows():
            logger.warning("request %s: its decode server %s failed (%s) and it was migrated %d times already",
                           call.request_id, instance.url, reason, migration.count)
            metrics.migrations.labels(reason=reason, outcome="failed").inc()
            await migration.release(upstream, call)
            return answer
        try:
            target = upstream.decode.pick(call.route, migration.failed)
        except (NoInstanceError, OverloadedError) as exc:
            logger.warning("request %s: its decode server %s failed (%s) and no other can take it: %s",
                           call.request_id, instance.url, reason, exc)
            metrics.migrations.labels(reason=reason, outcome="failed").inc()
            await migration.release(upstream, call)
            return answer
        choices = body.get("resume", {}).get("choices", ())
        replayed = sum(len(c["token_ids"]) for c in choices if KV_TRANSFER_PARAMS not in c)
        moved = sum(c[KV_TRANSFER_PARAMS].get("num_prompt_tokens", 0) for c in choices if KV_TRANSFER_PARAMS in c)
        logger.info("request %s: decode server %s %s (%s); %s on %s (%d tokens replayed, %d moved)",
                    call.request_id, instance.url, "handed it on" if reason == DRAIN else "failed", reason, outcome,
                    target.url, replayed, moved)
        trace = span(call, target, reason, replayed)
        opened = await upstream.open_decode(call, target, None, body=body, tried=set(migration.failed))
        if trace is not None:
            trace.set_attribute("pd.migrate.outcome", outcome if isinstance(opened, Opened) else "failed")
            trace.end()
        if outcome == "moved" and not isinstance(opened, Opened):  # no server read the KV: freed, and
            await migration.release(upstream, call)  # a refusal (expired, say) resumed from the tokens
            if not isinstance(opened, Broke) and opened.status_code in (400, 403):
                logger.warning("request %s: %s refused the KV handed on (HTTP %d); resumed from its tokens",
                               call.request_id, target.url, opened.status_code)
                continue
        migration.count += 1
        migration.handed = None  # read by the server that took it (or freed above)
        if isinstance(opened, Broke):
            instance, reason, answer = opened.instance, opened.reason, opened.answer
            continue
        metrics.migrations.labels(reason=reason, outcome=outcome if isinstance(opened, Opened) else "failed").inc()
        if isinstance(opened, Opened):
            metrics.migrated_tokens.labels(how="replayed").inc(replayed)
            metrics.migrated_tokens.labels(how="moved").inc(moved)
            if call.record is not None:
                call.record.migrated(outcome, opened.instance.url)
        return opened


async def watched(chunks: AsyncIterator[bytes], instance: Instance) -> AsyncIterator[bytes]:
    """`chunks` as they come; Gone once `instance` is out of the fleet, or its breaker is
    open, while no chunk came for WATCH_S (a server killed closes its connections; one cut
    off or frozen does not: only its lease ending says so, or, for a server the proxy was
    given, its /health probes failing)."""
    iterator = chunks.__aiter__()
    while True:
        step = asyncio.ensure_future(iterator.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({step}, timeout=WATCH_S)
                if done:
                    break
                if instance.gone:
                    raise Gone(f"{instance.url} left the fleet (no renewal within its lease) while the stream waited")
                if instance.breaker.state == "open":
                    raise Gone(f"{instance.url} stopped answering (its breaker opened: /health probes or requests "
                               "failed) while the stream waited")
        finally:
            if not step.done():
                step.cancel()
                await asyncio.wait({step})
        try:
            chunk = step.result()
        except StopAsyncIteration:
            return
        yield chunk
