"""Requests outlive their decode servers (`--migration-limit N`, default 3): when D fails
midway, the proxy takes the request to another decode server and the client's answer
goes on as if nothing had happened.

D has failed when its connection breaks or times out (`httpx.TransportError`: a killed
server, a reset, a peer silent past `--decode-timeout`), it says its engine died
(`engine_died`: a 500, or an error event in its stream), or it left the fleet while its
stream was silent (`gone`: a registered server whose lease ended without a renewal, cut
off or frozen with its connection open; looked at every WATCH_S of silence). Then:

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

from proxy.calls import Broke, Call, Opened
from proxy.instances import Instance, NoInstanceError, OverloadedError
from proxy.tap import Tap
from telemetry import tracing
from wire.codes import ENGINE_DIED
from wire.kv_params import KV_TRANSFER_PARAMS

logger = logging.getLogger(__name__)

REASONS = ("connection", ENGINE_DIED, "gone")
OUTCOMES = ("resumed", "replayed", "failed")
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
    return None


@dataclass
class Migration:
    """A request's migrations so far: the decode servers that failed it, how many times."""

    limit: int
    failed: set[str] = field(default_factory=set)
    count: int = 0
    broke_at: float | None = None  # when the stream last broke (monotonic): its pause runs from there

    def allows(self) -> bool:
        return self.count < self.limit

    def body(self, call: Call, tap: Tap | None) -> tuple[dict[str, Any], str]:
        """The body for the next decode server, and the outcome it makes (resumed or
        replayed): the client's, less P's parameters, with `resume` once the client has
        read some of the stream."""
        body = {k: v for k, v in call.body.items() if k != KV_TRANSFER_PARAMS}
        if tap is None or not tap.events:
            return body, "replayed"
        n = body.get("n") if isinstance(body.get("n"), int) else 1
        choices = [tap.choice(j) for j in range(n)]
        return body | {"return_token_ids": True, "resume": {"choices": [
            {"token_ids": list(c.token_ids), "text_chars": c.text_chars, "finish_reason": c.finish_reason}
            for c in choices]}}, "resumed"


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
            return answer
        migration.count += 1
        try:
            target = upstream.decode.pick(call.route, migration.failed)
        except (NoInstanceError, OverloadedError) as exc:
            logger.warning("request %s: its decode server %s failed (%s) and no other can take it: %s",
                           call.request_id, instance.url, reason, exc)
            metrics.migrations.labels(reason=reason, outcome="failed").inc()
            return answer
        replayed = sum(len(c["token_ids"]) for c in body.get("resume", {}).get("choices", ()))
        logger.info("request %s: decode server %s failed (%s); %s on %s (%d tokens replayed)", call.request_id,
                    instance.url, reason, outcome, target.url, replayed)
        trace = span(call, target, reason, replayed)
        opened = await upstream.open_decode(call, target, None, body=body, tried=set(migration.failed))
        if trace is not None:
            trace.set_attribute("pd.migrate.outcome", outcome if isinstance(opened, Opened) else "failed")
            trace.end()
        if isinstance(opened, Broke):
            instance, reason, answer = opened.instance, opened.reason, opened.answer
            continue
        metrics.migrations.labels(reason=reason, outcome=outcome if isinstance(opened, Opened) else "failed").inc()
        if isinstance(opened, Opened):
            metrics.migrated_tokens.labels(how="replayed").inc(replayed)
            if call.record is not None:
                call.record.migrated(outcome, opened.instance.url)
        return opened


async def watched(chunks: AsyncIterator[bytes], instance: Instance) -> AsyncIterator[bytes]:
    """`chunks` as they come; Gone once `instance` is out of the fleet while no chunk came
    for WATCH_S (a server killed closes its connections; one cut off or frozen does not,
    and only its lease ending says so)."""
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
        finally:
            if not step.done():
                step.cancel()
                await asyncio.wait({step})
        try:
            chunk = step.result()
        except StopAsyncIteration:
            return
        yield chunk
