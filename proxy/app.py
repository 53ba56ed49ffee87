"""The PD proxy: an OpenAI-compatible front for prefill and decode servers.

Routes: POST /v1/completions and /v1/chat/completions (`proxy.forward`: P, then D),
GET /v1/models (asked of a decode server), GET /metrics, GET /dashboard and
/dashboard/state (`proxy.dashboard`: the operator's live page), and GET /health, which
is always open; the others need `Authorization: Bearer KEY` when the proxy has an API
key (/dashboard, opened by a browser, also takes `?key=KEY`).
Every answer the proxy makes itself is OpenAI's `{"error": {...}}` JSON, a 500 too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from proxy.auth import require_key
from proxy.dashboard import Dashboard, page_response
from proxy.errors import error_response
from proxy.fleet_api import add_fleet_routes
from proxy.forward import forward
from proxy.instances import Instance
from proxy.kv_subscriber import follow_kv_events
from proxy.metrics import CONTENT_TYPE
from proxy.proxy_config import ProxyConfig
from proxy.recent import RecentRequests
from proxy.upstream import Upstream
from wire.codes import INTERNAL_ERROR
from wire.errors import ApiError

logger = logging.getLogger(__name__)

# Keep-alive: whoever pools a connection must drop it before the other side closes it, or
# a request is now and then sent on a connection the server is closing at that moment
# (a ReadError, which would mark a healthy server unhealthy). The proxy drops idle pooled
# connections to the servers after UPSTREAM_KEEPALIVE_S (`pd serve` keeps them 30 s), and
# its own listener keeps a client's idle connection SERVER_KEEPALIVE_S (clients such as
# httpx and the openai package pool them for 5 s).
UPSTREAM_KEEPALIVE_S = 2.0
SERVER_KEEPALIVE_S = 30
FLEET_TICK_S = 0.5  # how often leases that ended and drained removals are taken out of the fleet


def build_proxy_app(config: ProxyConfig) -> FastAPI:
    upstream = Upstream(config)
    app = FastAPI(title="pd proxy", lifespan=_lifespan(upstream), docs_url=None, redoc_url=None, openapi_url=None)
    dashboard = Dashboard(upstream)
    app.state.upstream = upstream
    _add_error_handlers(app)
    add_fleet_routes(app, upstream)
    keyed = [Depends(_key_check(config.api_key))]

    @app.post("/v1/completions", dependencies=keyed)
    async def completions(request: Request) -> Response:
        return await _forward(upstream, dashboard.recent, request, "/v1/completions")

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def chat_completions(request: Request) -> Response:
        return await _forward(upstream, dashboard.recent, request, "/v1/chat/completions")

    @app.get("/v1/models", dependencies=keyed)
    async def models(request: Request) -> Response:
        return await _models(upstream, request)

    @app.get("/metrics", dependencies=keyed)
    async def metrics() -> Response:
        return Response(upstream.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/dashboard", dependencies=[Depends(_key_check(config.api_key, in_query=True))])
    async def dashboard_page() -> Response:
        return page_response()

    @app.get("/dashboard/state", dependencies=keyed)
    async def dashboard_state() -> JSONResponse:
        return JSONResponse(await dashboard.state(), headers={"Cache-Control": "no-store"})

    @app.get("/health")
    async def health() -> JSONResponse:
        prefills = any(i.available for i in upstream.prefill.instances) or config.disagg_policy == "conditional"
        ok = prefills and any(i.available for i in upstream.decode.instances)  # conditional: D prefills without P
        body = {"status": "ok" if ok else "unavailable", "policy": config.policy,
                "prefill_policy": config.role_policy("prefill"), "decode_policy": config.role_policy("decode"),
                "disagg_policy": config.disagg_policy,
                "prefill": [i.state() for i in upstream.prefill.instances],
                "decode": [i.state() for i in upstream.decode.instances]}
        return JSONResponse(body, status_code=200 if ok else 503)

    return app


def _lifespan(upstream: Upstream) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256,
                              keepalive_expiry=UPSTREAM_KEEPALIVE_S)
        async with httpx.AsyncClient(limits=limits, timeout=upstream.timeout) as client:
            upstream.client = client
            await _probe_all(upstream)  # what /health and routing say is known from the first request on
            followers = _EventFollowers(upstream)
            upstream.fleet.on_join, upstream.fleet.on_leave = followers.join, followers.leave
            for instance in upstream.fleet.members():
                followers.join(instance)
            tasks = [asyncio.create_task(_probe_forever(upstream)),
                     asyncio.create_task(upstream.fleet.run(FLEET_TICK_S))]
            try:
                yield
            finally:
                upstream.fleet.on_join = upstream.fleet.on_leave = lambda instance: None
                tasks += followers.tasks.values()
                for task in tasks:
                    task.cancel()
                for task in tasks:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)  # ProxyError, and a body past the limit (wire/body.py)
    async def proxy_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)  # unknown route, wrong method
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError.of_http(exc).response()

    @app.exception_handler(Exception)  # a safety net: never Starlette's plain-text 500
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error serving %s", request.url.path, exc_info=exc)
        return error_response(f"internal error in the proxy: {type(exc).__name__}", 500, INTERNAL_ERROR)


def _key_check(api_key: str | None, in_query: bool = False) -> Callable[[Request], None]:
    """A dependency refusing (401) a client without `Authorization: Bearer api_key`
    (`in_query`: or without `?key=api_key`, for a page a browser opens)."""

    def check(request: Request) -> None:
        if api_key is not None:
            require_key(request, api_key, in_query=in_query)

    return check


async def _forward(upstream: Upstream, recent: RecentRequests, request: Request, endpoint: str) -> Response:
    upstream.arrivals += 1
    record = recent.start(endpoint, upstream.metrics.observe_answer)
    try:
        response = await forward(upstream, request, endpoint, record)
    except ApiError as exc:
        response = exc.response()
    except Exception:  # answered by the app's handler
        record.failed()
        raise
    upstream.metrics.requests.labels(endpoint=endpoint, status=str(response.status_code)).inc()
    return record.answered(response, [i.url for i in upstream.prefill.instances],
                           [i.url for i in upstream.decode.instances])


async def _models(upstream: Upstream, request: Request) -> Response:
    decode = upstream.decode.instances
    for instance in [i for i in decode if i.healthy] or decode:
        try:
            response = await upstream.client.get(f"{instance.url}/v1/models",
                                                 headers=upstream.headers(request, "models"))
        except httpx.HTTPError:
            continue
        return Response(response.content, response.status_code, media_type="application/json")
    return error_response("no decode server answered /v1/models", 503, "service_unavailable")


class _EventFollowers:
    """A task following the KV events of each instance whose role's pool routes by them,
    from when it joins (or takes that role) until it leaves."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        auth = upstream.config.server_authorization
        self.headers = {"Authorization": auth} if auth else {}
        self.tasks: dict[int, asyncio.Task[None]] = {}

    def join(self, instance: Instance) -> None:
        upstream = self.upstream
        if upstream.config.follows_events(instance.role) and id(instance) not in self.tasks:
            self.tasks[id(instance)] = asyncio.create_task(follow_kv_events(
                instance, upstream.client, self.headers,
                upstream.metrics.kv_events_malformed.labels(url=instance.url).inc, upstream.config.probe_interval_s))

    def leave(self, instance: Instance) -> None:
        task = self.tasks.pop(id(instance), None)
        if task is not None:
            task.cancel()
        instance.kv_index, instance.block_size = None, 0  # what it was known to hold is not followed now


async def _probe_forever(upstream: Upstream) -> None:
    while True:
        await asyncio.sleep(upstream.config.probe_interval_s)
        await _probe_all(upstream)


async def _probe_all(upstream: Upstream) -> None:
    await asyncio.gather(upstream.prefill.probe(upstream.client), upstream.decode.probe(upstream.client))
