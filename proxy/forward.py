"""One client request through the proxy (DESIGN.md, "PD protocol").

1. Read the body (at most `max_request_bytes`: 413) and parse it strictly (400).
2. Pick the decode server first: with none healthy the answer is 503 and nothing is sent
   to a prefill server, which would otherwise keep blocks that nobody reads.
3. Prefill: the body goes to a P with `stream=false` and
   `kv_transfer_params={"do_remote_decode": true}` (`prefill_body`); P answers with the
   `kv_transfer_params` under which it keeps the prompt's blocks.
4. Decode: the original body plus those parameters goes to D, whose answer (streamed or
   not) is passed back unchanged. Both get the same `X-Request-Id`. A D that fails the
   request midway (its connection lost, its engine dead) is replaced by another: the
   request is sent again whole, or its stream resumed from the tokens its client has
   (`migration.py`, `--migration-limit`).

Under `--disagg-policy conditional`, step 3 is skipped for a request D can well compute
itself (`disagg.py`), or that no P could be reached for: the body goes to D as it is;
and P reads from D first a prefix that D holds and P lacks (`reuse.py`). Which path a
request took comes back in the `X-PD-Path` header (`local`, `disaggregated` or
`disaggregated+reuse`).

Once P holds blocks for the request, a D that refuses it (4xx), fails (5xx), cannot be
reached at all, or a client that disconnects before D's response is opened, makes the
proxy ask P to release them (`Upstream.release`). A client that disconnects closes
the request being waited on (P's or D's), which aborts it on that server; mid-stream, it
closes D's stream, which aborts the request on D and frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect

from proxy import spans
from proxy.admission import QueueFull, QueueTimeout
from proxy.answers import overloaded_response
from proxy.body import BodyError, parse_body
from proxy.calls import Broke, Call, NoRoom, Opened, Prefilled, Unreached
from proxy.disagg import DISAGGREGATED, LOCAL, REUSE, choose_path, reuse_tokens
from proxy.errors import error_response
from proxy.instances import EmptyPoolError, Instance, NoInstanceError, OverloadedError, Route
from proxy.migration import DRAIN, Gone, HandedOn, Migration, failure, paused, reopen, resumable, watched
from proxy.reuse import prefill_reusing
from proxy.tap import Tap
from proxy.upstream import Upstream
from wire.body import read_body
from wire.codes import NO_INSTANCE
from wire.errors import error_body
from wire.headers import PD_PATH, REQUEST_ID

logger = logging.getLogger(__name__)

PREFIX_KEY_CHARS = 256  # of prompt text: about the first 4 blocks of 16 tokens
PREFIX_KEY_TOKENS = 64  # of a token-id prompt
DISCONNECT_POLL_S = 0.1
CLIENT_CLOSED = 499  # nginx's status for "the client closed the request"; nobody reads it
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected while the proxy waited; `result` is what the awaited
    call returned if it finished all the same (None if it was cancelled or failed)."""

    def __init__(self, result: Any = None) -> None:
        super().__init__("the client disconnected")
        self.result = result


def prefix_key(body: dict[str, Any]) -> str:
    """What requests sharing a prompt prefix have in common: the first characters of the
    prompt (or of the chat messages' contents), or the first token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        return json.dumps(prompt[:PREFIX_KEY_TOKENS])
    if isinstance(prompt, str):
        return prompt[:PREFIX_KEY_CHARS]
    messages = body.get("messages")
    text = ""
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content
                              if isinstance(part, dict) and isinstance(part.get("text", ""), str))
        text += f"{message.get('role', '') if isinstance(message, dict) else ''}:{content or ''}\n"
        if len(text) >= PREFIX_KEY_CHARS:
            break
    return text[:PREFIX_KEY_CHARS]


async def forward(upstream: Upstream, request: Request, endpoint: str, record: Any = None) -> Response:
    """The client's answer; raises BodyError for a body the proxy refuses itself.
    `record`: the dashboard's record of the request (recent.py), told of migrations."""
    config = upstream.config
    try:
        body = parse_body(await read_body(request, config.max_request_bytes), config.max_depth)
    except ClientDisconnect:
        return Response(status_code=CLIENT_CLOSED)
    rank = priority(body, config.max_client_priority)  # the queue's: taken out, as the servers do not take it
    body.pop("priority", None)
    request_id = request.headers.get(REQUEST_ID) or f"pdx-{uuid.uuid4().hex}"
    call = Call(endpoint, body, upstream.headers(request, request_id), Route(prefix_key(body)), request_id,
                record=record)
    spans.begin(call, request.headers)
    response = None
    try:
        response = await _answer(upstream, request, call, rank)
        return response
    finally:
        if not isinstance(response, StreamingResponse):  # a stream's span ends with it (`_relay`)
            spans.answered(call, response)


async def _answer(upstream: Upstream, request: Request, call: Call, rank: int) -> Response:
    """The client's answer to `call`: placed, prefilled, decoded."""
    config = upstream.config
    body = call.body
    if config.needs_tokens:
        call.route.tokens = await upstream.tokenize(call)
        call.route.salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
    try:
        placed = await _place(upstream, request, call, rank)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    if not isinstance(placed, tuple):
        return placed
    decode, prefilled = placed
    try:
        return await _decode(upstream, request, call, prefilled, decode)
    finally:
        call.unbind()


async def _place(upstream: Upstream, request: Request, call: Call,
                 rank: int) -> tuple[Instance, Prefilled | None] | Response:
    """The decode server picked (bound to the call) and P's parameters (None: D prefills
    the request itself); or the response for the client. When no server has room, the
    request waits in the queue (admission.py) and tries again as room frees up;
    ClientGone if the client leaves."""
    admission = upstream.admission
    ticket, counted = admission.ticket(rank), False
    while True:
        try:
            await until_disconnected(request, admission.turn(ticket))
        except QueueFull as exc:
            return upstream.queue_refused("full", exc)
        except QueueTimeout as exc:
            return upstream.queue_refused("timeout", exc)
        finally:
            if ticket.queued and not counted:  # it waited in line (behind others, or for room)
                counted = True
                upstream.metrics.queued.inc()
        outcome = await _try_place(upstream, request, call)
        if not isinstance(outcome, NoRoom):
            admission.placed()
            return outcome
        if not admission.enabled:
            return upstream.refuse(outcome)
        admission.no_room(ticket, outcome.retry_after_s)


async def _try_place(upstream: Upstream, request: Request,
                     call: Call) -> tuple[Instance, Prefilled | None] | NoRoom | Response:
    """One try: pick D, bind it, and prefill on a P (P's blocks released if the client
    left meanwhile) unless D is to prefill the request itself."""
    try:
        decode = upstream.decode.pick(call.route)
    except OverloadedError as exc:
        return NoRoom(overloaded_response(str(exc)), overloaded="decode")
    except NoInstanceError as exc:
        return error_response(f"{exc}: the request is not sent to a prefill server", 503, "service_unavailable",
                              NO_INSTANCE if isinstance(exc, EmptyPoolError) else None)
    call.bind(decode)  # counted against its --max-outstanding from now
    config = upstream.config
    path = choose_path(call.route, decode, upstream.prefill, config.disagg_policy, config.local_prefill_max_tokens,
                       config.reuse_min_tokens)
    prefilled = None
    if path != LOCAL:
        prefill = upstream.prefill_once(call) if path == DISAGGREGATED else prefill_reusing(
            upstream, call, decode, reuse_tokens(call.route, decode, upstream.prefill, config.reuse_min_tokens))
        try:
            prefilled = await until_disconnected(request, prefill)
        except ClientGone as gone:
            call.unbind()
            if isinstance(gone.result, Prefilled):
                await upstream.release(gone.result, call.headers)
            raise
        if isinstance(prefilled, Unreached) and config.disagg_policy == "conditional":
            logger.warning("no prefill server took request %s: the decode server prefills it", call.request_id)
            path, prefilled = LOCAL, None
        elif not isinstance(prefilled, Prefilled):
            call.unbind()
            return prefilled.answer if isinstance(prefilled, Unreached) else prefilled
        else:
            path = REUSE if prefilled.reused else DISAGGREGATED
    upstream.metrics.paths.labels(path=path).inc()
    return decode, prefilled


def priority(body: dict[str, Any], most_urgent: int) -> int:
    """The body's `priority` (lower first; 0 when absent). BodyError if not an integer of
    32 bits, or more urgent (lower) than `most_urgent` (`--max-client-priority`)."""
    value = body.get("priority", 0)
    if type(value) is not int or not -2**31 <= value < 2**31:
        error = BodyError("priority must be an integer of 32 bits (lower is served first)", "invalid_type")
    elif value < most_urgent:
        error = BodyError(f"priority {value} is more urgent than this proxy lets a client ask (at most "
                          f"{most_urgent}: lower is served first)", "invalid_value")
    else:
        return value
    error.path = ["priority"]
    raise error.located()


async def _decode(upstream: Upstream, request: Request, call: Call, prefilled: Prefilled | None,
                  decode: Instance) -> Response:
    """D's answer for the client; P's blocks released whenever no D will read them. A PD
    request the canary samples is run again alone once its answer is whole (canary.py).
    A stream that may be resumed elsewhere, or one the canary samples, is read as it
    passes (`Tap`)."""
    call.canary = prefilled is not None and upstream.canaries.samples(call)
    resumes = call.stream and upstream.config.migration_limit > 0 and resumable(call.body)
    if call.canary or resumes:
        call.tap = Tap(keep=call.body.get("return_token_ids") is True, hold_errors=resumes)
    response = await _decode_answer(upstream, request, call, prefilled, decode)
    if call.canary and not call.stream:  # a stream's canary runs as the stream ends (`_relay`)
        exclude = {decode.url} | ({prefilled.instance.url} if prefilled is not None else set())
        upstream.canaries.done(call.tap, response.status_code == 200, upstream.canary(call, call.tap, exclude))
    return response


async def _decode_answer(upstream: Upstream, request: Request, call: Call, prefilled: Prefilled | None,
                         decode: Instance) -> Response:
    migration = Migration(upstream.config.migration_limit)
    try:
        opened = await until_disconnected(request, _opened(upstream, call, migration, upstream.open_decode(
            call, decode, None if prefilled is None else prefilled.params)))
    except ClientGone as gone:
        if isinstance(gone.result, Opened):
            await gone.result.close()  # aborts the request on D
        await _release(upstream, prefilled, call)
        return Response(status_code=CLIENT_CLOSED)
    if not isinstance(opened, Opened):
        await _release(upstream, prefilled, call)
        return opened
    path = LOCAL if prefilled is None else REUSE if prefilled.reused else DISAGGREGATED
    headers = {REQUEST_ID: call.request_id, PD_PATH: path} | call.route_headers()
    if migration.count:  # P's blocks are not read (the failed D may have): free them
        await _release(upstream, prefilled, call)
        prefilled = None
    if call.stream:
        exclude = {opened.instance.url} | ({prefilled.instance.url} if prefilled is not None else set())
        return StreamingResponse(_relay(upstream, opened, call, path, exclude, migration, prefilled),
                                 media_type="text/event-stream", headers=headers | {"Cache-Control": "no-cache"})
    answer = await _whole(upstream, request, call, opened, migration)
    if migration.count:
        await _release(upstream, prefilled, call)
    if not isinstance(answer, tuple):
        return answer
    status, content = answer
    if call.tap is not None and status == 200:
        content = call.tap.body(content)
    return Response(content, status, media_type="application/json", headers=headers)


async def _whole(upstream: Upstream, request: Request, call: Call, opened: Opened,
                 migration: Migration) -> tuple[int, bytes] | Response:
    """D's unstreamed answer (status, body); where D fails it before the end, the request
    sent again, whole, to another D (nothing of it reached the client), or a 502."""
    while True:
        try:
            return opened.response.status_code, await until_disconnected(request, _read(opened))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        except (httpx.HTTPError, Gone) as exc:
            if isinstance(exc, httpx.TransportError):
                upstream.failed(opened.instance, f"{type(exc).__name__}: {exc}")
            answer = error_response(f"the decode server {opened.instance.url} failed: {exc}", 502)
            if (reason := failure(exc)) is None:
                return answer
            failed = opened.instance
        finally:
            await opened.close()
        try:
            again = await until_disconnected(request, reopen(upstream, call, None, migration, failed, reason, answer))
        except ClientGone as gone:
            if isinstance(gone.result, Opened):
                await gone.result.close()
            return Response(status_code=CLIENT_CLOSED)
        if not isinstance(again, Opened):
            return again
        opened = again


async def _read(opened: Opened) -> bytes:
    """D's whole answer; Gone if D leaves the fleet while it is awaited (migration.py)."""
    return b"".join([chunk async for chunk in watched(opened.response.aiter_bytes(), opened.instance)])


async def _opened(upstream: Upstream, call: Call, migration: Migration,
                  opening: Awaitable[Opened | Response | Broke]) -> Opened | Response:
    """What `opening` opened; where a decode server took the request and failed it before
    answering anything, the request taken to another (migration.py)."""
    opened = await opening
    if isinstance(opened, Broke):
        opened = await reopen(upstream, call, call.tap, migration, opened.instance, opened.reason, opened.answer)
    return opened


async def _release(upstream: Upstream, prefilled: Prefilled | None, call: Call) -> None:
    if prefilled is not None:
        await upstream.release(prefilled, call.headers)


class _Broken:
    """How one decode server's stream ended: `reason` (migration.REASONS) and `why` when
    it failed the request; both None when it ended (or failed the request for the
    request's own reasons, which the client is told as D said)."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.why: str | None = None
        self.sent = False  # anything of the answer reached the client (from any server)


async def _relay(upstream: Upstream, opened: Opened, call: Call, path: str, exclude: set[str],
                 migration: Migration, prefilled: Prefilled | None) -> AsyncIterator[bytes]:
    """D's stream, byte for byte (less the token ids the tap asked D for); closing it
    (the client left) closes D's request. Where D fails midway, the stream goes on from
    another D (migration.py), or ends with an error event."""
    status = CLIENT_CLOSED  # unless it is sent to its end
    tap, broken = call.tap, _Broken()
    try:
        while True:
            async for chunk in _pass_on(upstream, opened, tap, migration, broken):
                yield chunk
            if broken.why is None:
                status = 200
                break
            await opened.close()
            answer = error_response(f"the decode server failed mid-stream: {broken.why}", 502)
            if broken.reason is not None and (not broken.sent or (tap is not None and tap.hold_errors)):
                migration.broke_at = time.monotonic()
                await _release(upstream, prefilled, call)  # the failed D may have read them, or not
                prefilled = None
                resumed = await reopen(upstream, call, tap, migration, opened.instance, broken.reason, answer)
                if isinstance(resumed, Opened):
                    opened = resumed
                    exclude.add(opened.instance.url)
                    if tap is not None:
                        tap.switched()
                    continue
            status = 502
            yield _error_event(error_body(f"the decode server failed mid-stream: {broken.why}", "bad_gateway"))
            break
    finally:
        await opened.close()
        if call.canary:
            upstream.canaries.done(tap, status == 200, upstream.canary(call, tap, exclude))
        spans.end(call, status, path)


async def _pass_on(upstream: Upstream, opened: Opened, tap: Tap | None, migration: Migration,
                   broken: _Broken) -> AsyncIterator[bytes]:
    """One decode server's stream to the client, until it ends or fails (`broken` says)."""
    broken.reason = broken.why = None
    try:
        async for chunk in watched(opened.response.aiter_raw(), opened.instance):
            if tap is not None:
                chunk = tap.chunk(chunk)
            if chunk:
                if (pause := paused(migration)) is not None:
                    upstream.metrics.migration_pause.observe(pause)
                broken.sent = True
                yield chunk
            if tap is not None and tap.error is not None:
                break
        if tap is not None and tap.error is not None:  # D said it failed: for the request's own reasons?
            error = tap.error
            broken.reason, broken.why = failure(error=error), str(error.get("message"))
            if broken.reason is None:  # the request's own: passed on as D said it
                broken.why = None
                yield _error_event({"error": error})
            elif broken.reason == DRAIN:  # handed on with its KV
                migration.handed = HandedOn.of(opened.instance, error)
        elif tap is not None and (rest := tap.flush()):
            yield rest
    except (httpx.HTTPError, Gone) as exc:  # D failed midway
        if isinstance(exc, httpx.TransportError):
            upstream.failed(opened.instance, f"{type(exc).__name__}: {exc}")
        broken.reason, broken.why = failure(exc), f"{type(exc).__name__}: {exc}"


def _error_event(error: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


async def until_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """What `awaitable` returns; ClientGone (the awaited call cancelled) as soon as the
    client is seen to have disconnected."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone(await _cancel(task))
    finally:
        if not task.done():
            await _cancel(task)


async def _cancel(task: asyncio.Future[T]) -> T | None:
    """Cancel `task` and wait for it; what it returned if it finished first."""
    task.cancel()
    await asyncio.wait({task})
    if task.cancelled() or task.exception() is not None:
        return None
    return task.result()
