"""The OpenAI-compatible FastAPI app: routes, auth, errors, streaming.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (behind the
optional API key), GET /health, GET /metrics (always open). Every refusal is OpenAI's
`{"error": {...}}` with a 4xx status; a dead engine is a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

import anyio
import msgspec
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pd.engine.client import EngineDeadError, EngineNotRunningError, RequestFailedError, RequestRefusedError
from pd.kv_transfer.signing import TransferParamsGuard
from pd.server.chat import ChatTemplate
from pd.server.generation import Delta, Generation
from pd.server.limits import DEFAULT_LIMITS, RequestLimits
from pd.server.metrics import CONTENT_TYPE, ServerMetrics
from pd.server.protocol import ChatCompletionRequest, CompletionRequest, RequestError, parse_body
from pd.server.responses import CHAT, COMPLETION, Answer, Shape
from pd.server.router_info import router_info_routes
from pd.server.serving import Prepared, Server
from pd.server.spans import RequestSpan
from telemetry import logs, tracing
from wire.body import read_body
from wire.codes import (
    ENGINE_DEAD,
    ENGINE_DIED,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    KV_HELD_LIMIT,
    KV_LOAD_FAILED,
    MIGRATED,
    SERVER_DRAINING,
)
from wire.errors import ApiError
from wire.headers import PD_MIGRATABLE, REQUEST_ID, retry_after
from wire.kv_params import KV_TRANSFER_PARAMS, REMOTE_REQUEST_ID

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is there


def build_app(client: Any, tokenizer: Any, served_model_name: str, api_key: str | None = None,
              chat_template: ChatTemplate | None = None, role: str = "both",
              transfer_guard: TransferParamsGuard | None = None, limits: RequestLimits = DEFAULT_LIMITS) -> FastAPI:
    """The app serving `client`'s engine as `served_model_name`. `chat_template` defaults
    to the one in the tokenizer's config; `role` is reported by /health; `transfer_guard`
    decides which remote-prefill parameters are acted on (default: unsigned ones naming a
    loopback peer); `limits` bound what one request may cost (a body past
    `limits.max_request_bytes` is refused, 413, before it is read whole)."""
    template = chat_template or ChatTemplate.from_config(tokenizer.config)
    server = Server(client, tokenizer, served_model_name, template, role, transfer_guard, limits)
    metrics = ServerMetrics(lambda: client.stats, lambda: client.is_alive, lambda: client.restarts)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await client.attach()  # so that an engine death is noticed before any request
        try:
            yield
        finally:
            server.close()  # its grammar checker process

    app = FastAPI(title="pd-serve", lifespan=lifespan)
    app.state.server = server
    app.state.metrics = metrics
    _add_error_handlers(app)
    app.include_router(_v1_router(server, metrics, api_key))
    app.include_router(router_info_routes(server), prefix="/v1",
                       dependencies=[Depends(_api_key_check(api_key))])
    app.include_router(_open_router(server, metrics))
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)  # RequestError, and a body past the limit (wire/body.py)
    async def request_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)  # a safety net: bodies are parsed by parse_body
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or None
        return RequestError(f"{param}: {first.get('msg', 'invalid request')}", param=param).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error serving %s", request.url.path)
        return RequestError(f"internal error: {type(exc).__name__}", type=INTERNAL_ERROR, status=500).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError.of_http(exc).response()


def _api_key_check(api_key: str | None) -> Callable[[Request], None]:
    def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise RequestError("missing or incorrect API key (send Authorization: Bearer <key>)",
                               code="invalid_api_key", status=401)

    return check


class ReleaseBody(msgspec.Struct, forbid_unknown_fields=True):
    """POST /v1/kv/release: the `remote_request_id` of kv_transfer_params this prefill
    server answered, whose decode request failed or was refused, and their `signature`
    (required when they were signed: only their holder may release them)."""

    remote_request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    signature: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")] | None = None


def _v1_router(server: Server, metrics: ServerMetrics, api_key: str | None) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_check(api_key))])
    created = int(time.time())

    @router.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": server.served_model_name, "object": "model", "created": created, "owned_by": "pd-serve",
            "max_model_len": server.max_model_len}]}

    @router.post("/completions")
    async def completions(request: Request) -> Response:
        raw = await read_body(request, server.limits.max_request_bytes)
        request_id = server.request_id(request.headers.get(REQUEST_ID), "cmpl")
        prepared = await server.off_loop(lambda: server.prepare_completion(parse_body(raw, CompletionRequest),
                                                                           request_id))
        return await _serve(server, metrics, request, prepared, COMPLETION)

    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        raw = await read_body(request, server.limits.max_request_bytes)
        request_id = server.request_id(request.headers.get(REQUEST_ID), "chatcmpl")
        prepared = await server.off_loop(lambda: server.prepare_chat(parse_body(raw, ChatCompletionRequest),
                                                                     request_id))
        return await _serve(server, metrics, request, prepared, CHAT)

    @router.post("/kv/release")
    async def release(request: Request) -> dict[str, bool]:
        """Free now the blocks kept for a prefilled request no decode server will read."""
        raw = await read_body(request, 4096)
        try:
            body = msgspec.json.decode(raw, type=ReleaseBody)
        except Exception as e:  # any decode failure (a string that is not UTF-8 raises UnicodeDecodeError)
            raise RequestError(f"the body must be {{\"remote_request_id\": <string>, \"signature\": <hex or "
                               f"null>}}: {e}", param=REMOTE_REQUEST_ID) from None
        server.check_holder(body.remote_request_id, body.signature)
        return {"released": await server.release_held(body.remote_request_id)}

    return router


def _open_router(server: Server, metrics: ServerMetrics) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> JSONResponse:
        client = server.client
        if client.is_alive:
            return JSONResponse({"status": "ok", "role": server.role, "engine_pid": client.pid,
                                 "draining": server.draining})
        return JSONResponse({"status": "engine dead", "error": client.dead_error, "role": server.role,
                             "engine_pid": client.pid},
                            status_code=503)

    @router.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return router


# ---- serving one request ----------------------------------------------------------


async def _serve(server: Server, metrics: ServerMetrics, request: Request, prepared: Prepared,
                 shape: Shape) -> Response:
    if not server.client.is_alive:
        raise engine_not_running(server.client.dead_error)
    if server.draining:
        raise RequestError("the server is draining: it takes no new request (another server may take it)",
                           type="service_unavailable", code=SERVER_DRAINING, status=503,
                           headers=retry_after(RETRY_AFTER_S))
    server.claim(prepared.request_id)
    if prepared.release_first is not None:
        await server.release_held(prepared.release_first)
    span = RequestSpan(request.headers, prepared.request_id, server.role, prepared.num_prompt_tokens) \
        if tracing.enabled() else None
    logs.bind(prepared.request_id, None if span is None else span.trace_id)
    generation = Generation(server.client, server.tokenizer, prepared, metrics, span=span)
    answer = Answer(shape, generation, server.tokenizer.token_strings)
    headers = {REQUEST_ID: prepared.request_id}
    if prepared.stream:
        if request.headers.get(PD_MIGRATABLE) == "1":  # the proxy takes it elsewhere when this server drains
            server.migratable[prepared.request_id] = prepared.engine_request.request_id

        def closed() -> None:
            server.in_flight.discard(prepared.request_id)
            server.migratable.pop(prepared.request_id, None)
            generation.end_span()  # a stream closed before it started

        return _ClosingStreamingResponse(_sse(server, answer), closed,
                                         media_type="text/event-stream",
                                         headers=headers | {"Cache-Control": "no-cache"})
    try:
        done = await _collect_unless_disconnected(generation, request)
    finally:
        server.in_flight.discard(prepared.request_id)
    if not done:  # the client left; nobody reads this
        return Response(status_code=499)
    if generation.kv_transfer_params is not None:
        server.note_held(generation.kv_transfer_params)
    body = _envelope(server, generation, shape.object_name)
    body |= {"choices": answer.choices(), "usage": generation.usage(),
             KV_TRANSFER_PARAMS: generation.transfer_params_json}
    return JSONResponse(body, headers=headers)


def _envelope(server: Server, generation: Generation, object_name: str) -> dict[str, Any]:
    return {"id": generation.prepared.request_id, "object": object_name, "created": generation.created,
            "model": server.served_model_name}


ENGINE_ERRORS = (EngineDeadError, RequestRefusedError, RequestFailedError)
# error code from the engine -> (HTTP status, OpenAI error type)
ENGINE_ERROR_STATUS = {
    INVALID_REQUEST: (400, "invalid_request_error"),
    KV_HELD_LIMIT: (503, "service_unavailable"),
    KV_LOAD_FAILED: (502, "bad_gateway"),
    INTERNAL_ERROR: (500, INTERNAL_ERROR),
}
RETRY_AFTER_S = 1  # what a client refused for the held-blocks limit is told to wait


def engine_not_running(why: str | None) -> RequestError:
    """503 engine_dead: nothing of the request reached the engine (another server may take it)."""
    return RequestError(f"the engine is not running: {why}", type="service_unavailable", code=ENGINE_DEAD,
                        status=503, headers=retry_after(RETRY_AFTER_S))


def engine_error(exc: Exception) -> RequestError:
    """The client's answer to an engine that died, refused or failed its request."""
    if isinstance(exc, EngineNotRunningError):
        return engine_not_running(str(exc))
    if isinstance(exc, EngineDeadError):  # while serving this request: it may be what killed it
        return RequestError(f"the engine died while serving this request: {exc}", type=INTERNAL_ERROR,
                            code=ENGINE_DIED, status=500)
    code = getattr(exc, "code", None) or INVALID_REQUEST
    status, kind = ENGINE_ERROR_STATUS.get(code, (500, INTERNAL_ERROR))
    headers = retry_after(RETRY_AFTER_S) if code == KV_HELD_LIMIT else None
    return RequestError(str(exc), type=kind, code=code, status=status, headers=headers)


async def _collect(generation: Generation) -> None:
    try:
        async with contextlib.aclosing(generation.deltas()) as deltas:
            async for _ in deltas:
                pass
    except ENGINE_ERRORS as e:
        raise engine_error(e) from None


async def _collect_unless_disconnected(generation: Generation, request: Request) -> bool:
    """Run the generation to its end (True), or False if the client disconnected first
    (the request is then aborted in the engine: cancelling the task closes its engine
    stream)."""
    task = asyncio.ensure_future(_collect(generation))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                task.result()
                return True
            if await request.is_disconnected():
                logger.info("client of %s disconnected; aborting it", generation.prepared.request_id)
                return False
    finally:
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True), contextlib.suppress(asyncio.CancelledError):
                await task


async def _sse(server: Server, answer: Answer) -> AsyncIterator[str]:
    """The SSE stream: one chunk per delta (for chat, first each choice's role), the
    finish reason and kv_transfer_params in each choice's last, a usage chunk if asked
    for, then [DONE]. An engine failure midway is an error event."""
    generation, shape = answer.generation, answer.shape
    if answer.opens_with_role:
        chunk = _envelope(server, generation, shape.chunk_object_name) | {"choices": answer.role_chunk_choices()}
        yield _event(chunk | ({"usage": generation.usage()} if answer.prepared.continuous_usage else {}))
    try:
        async with contextlib.aclosing(generation.deltas()) as deltas:
            async for delta in deltas:
                choice = answer.chunk_choice(delta)
                if choice is not None:
                    yield _chunk(server, answer, delta, choice)
        if generation.migrated:
            yield _event(_handed_on(server, generation))
        elif generation.prepared.include_usage:
            yield _event(_envelope(server, generation, shape.chunk_object_name)
                         | {"choices": [], "usage": generation.usage()})
    except ENGINE_ERRORS as e:
        yield _event(engine_error(e).body())  # as an unstreamed answer's error: the code says what failed
    yield "data: [DONE]\n\n"


def _handed_on(server: Server, generation: Generation) -> dict[str, Any]:
    """The error event that ends a stream this draining server handed on: for each choice,
    the kv_transfer_params of its KV kept here for the server that goes on with it (null:
    none kept, or the choice had ended)."""
    exports = [generation.exports.get(i) for i in range(len(generation.sequences))]
    for params in exports:
        if params is not None:
            server.note_held(params)  # its holder (the proxy) may release it
    error = RequestError("the server is draining: this stream goes on at another server from its KV",
                         type="service_unavailable", code=MIGRATED, status=503).body()
    error["error"][KV_TRANSFER_PARAMS] = [None if p is None else p.to_json() for p in exports]
    return error


def _chunk(server: Server, answer: Answer, delta: Delta, choice: dict[str, Any]) -> str:
    chunk = _envelope(server, answer.generation, answer.shape.chunk_object_name)
    chunk["choices"] = [choice]
    if answer.prepared.continuous_usage:
        chunk["usage"] = answer.generation.usage()
    if delta.finish_reason is not None:
        chunk[KV_TRANSFER_PARAMS] = answer.generation.transfer_params_json
    return _event(chunk)


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _ClosingStreamingResponse(StreamingResponse):
    """Closes its generator however the response ends, then calls `on_close`. When the
    client disconnects while the generator is parked at a `yield`, Starlette only stops
    iterating; closing it here runs its `finally` blocks now, which abort the engine
    request."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                with anyio.CancelScope(shield=True):
                    await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                self.on_close()
