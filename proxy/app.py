"""The PD proxy: an OpenAI-compatible front for prefill and decode servers.

Per request (DESIGN.md, "PD protocol"): the body goes to a prefill server with
`max_tokens=1`, `stream=false`, no `stream_options`, no `min_tokens` (kept back for D)
and `kv_transfer_params={"do_remote_decode": true}`; then the original body plus the
`kv_transfer_params` P answered goes to a decode server, whose answer (streamed or not)
is passed back unchanged. Both get the same `X-Request-Id`.

Faults: a prefill server that cannot be reached or answers 5xx is marked unhealthy and
the request tries another (none left: 503); a decode server that cannot be reached is
marked unhealthy and another is tried with the same parameters (P keeps the blocks
under its lease); a decode failure after that is a 502. A client that disconnects
closes the decode request, which aborts it on D and frees its blocks. The servers'
own 4xx answers (bad requests) are passed back as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.instances import Instance, InstancePool, NoInstanceError

logger = logging.getLogger(__name__)

PREFIX_KEY_CHARS = 256  # of prompt text: about the first 4 blocks of 16 tokens
PREFIX_KEY_TOKENS = 64  # of a token-id prompt
DISCONNECT_POLL_S = 0.1
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def error(message: str, status: int, type: str = "bad_gateway", code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type, "param": None, "code": code}},
                        status_code=status)


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
    text = ""
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        text += f"{message.get('role', '') if isinstance(message, dict) else ''}:{content or ''}\n"
        if len(text) >= PREFIX_KEY_CHARS:
            break
    return text[:PREFIX_KEY_CHARS]


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body P gets: one token, not streamed, asked to keep its blocks for D."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "max_completion_tokens")}
    return out | {"max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}


class ProxyCollector(Collector):
    """Per-instance health, outstanding requests, requests sent and failures."""

    def __init__(self, pools: list[InstancePool]) -> None:
        self.pools = pools

    def collect(self) -> Iterator[Metric]:
        labels = ["url", "role"]
        healthy = GaugeMetricFamily("pd_proxy_instance_healthy", "1 if the instance is taken for requests.", labels=labels)
        outstanding = GaugeMetricFamily("pd_proxy_instance_outstanding", "Requests in flight on the instance.", labels=labels)
        sent = CounterMetricFamily("pd_proxy_instance_requests", "Requests sent to the instance.", labels=labels)
        failed = CounterMetricFamily("pd_proxy_instance_failures", "Failures that marked the instance unhealthy.",
                                     labels=labels)
        for pool in self.pools:
            for i in pool.instances:
                healthy.add_metric([i.url, i.role], int(i.healthy))
                outstanding.add_metric([i.url, i.role], i.outstanding)
                sent.add_metric([i.url, i.role], i.requests)
                failed.add_metric([i.url, i.role], i.failures)
        yield from (healthy, outstanding, sent, failed)


class Proxy:
    def __init__(self, prefill: InstancePool, decode: InstancePool, api_key: str | None = None,
                 timeout_s: float = 600.0) -> None:
        self.prefill = prefill
        self.decode = decode
        self.api_key = api_key
        self.timeout = httpx.Timeout(timeout_s, connect=5.0)
        self.client: httpx.AsyncClient | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(ProxyCollector([prefill, decode]))
        self.requests = Counter("pd_proxy_requests", "Requests answered, by endpoint and status code.",
                                ["endpoint", "status"], registry=self.registry)

    def headers(self, request: Request, request_id: str) -> dict[str, str]:
        headers = {"X-Request-Id": request_id}
        auth = f"Bearer {self.api_key}" if self.api_key else request.headers.get("authorization")
        return headers | ({"Authorization": auth} if auth else {})

    async def prefill_once(self, endpoint: str, body: dict, headers: dict, key: str) -> dict | Response:
        """P's kv_transfer_params, or the response to give the client (P's own 4xx, 503
        when no prefill server is left, 502 when P answered without parameters)."""
        tried: set[str] = set()
        while True:
            try:
                instance = self.prefill.pick(key, tried)
            except NoInstanceError as exc:
                return error(f"{exc}: cannot prefill the request", 503, "service_unavailable")
            tried.add(instance.url)
            try:
                response = await self._post(instance, endpoint, prefill_body(body), headers)
            except httpx.HTTPError as exc:
                self.failed(instance, f"{type(exc).__name__}: {exc}")
                continue
            if response.status_code >= 500:
                self.failed(instance, f"HTTP {response.status_code}: {response.text[:200]}")
                continue
            if response.status_code != 200:  # the request's fault: every P would say the same
                return Response(response.content, response.status_code, media_type="application/json")
            try:
                params = response.json().get("kv_transfer_params")
            except (ValueError, AttributeError):
                self.failed(instance, f"an answer that is not a JSON object: {response.text[:200]!r}")
                continue
            if not params:
                return error(f"the prefill server {instance.url} kept no KV for the request "
                             "(is it started with --kv-connector nixl?)", 502)
            return params

    async def _post(self, instance: Instance, endpoint: str, body: dict, headers: dict) -> httpx.Response:
        instance.outstanding += 1
        instance.requests += 1
        try:
            return await self.client.post(instance.url + endpoint, json=body, headers=headers, timeout=self.timeout)
        finally:
            instance.outstanding -= 1

    def failed(self, instance: Instance, why: str) -> None:
        logger.warning("%s server %s failed: %s; marked unhealthy", instance.role, instance.url, why)
        instance.mark_failed(why)

    async def open_decode(self, endpoint: str, body: dict, headers: dict, key: str
                          ) -> tuple[Instance, httpx.Response] | Response:
        """D's response, headers read and body not yet (to stream or read), with its
        instance counted outstanding; or the error response for the client."""
        tried: set[str] = set()
        while True:
            try:
                instance = self.decode.pick(key, tried)
            except NoInstanceError as exc:
                return error(f"{exc}: cannot decode the request", 503, "service_unavailable")
            tried.add(instance.url)
            instance.outstanding += 1
            instance.requests += 1
            request = self.client.build_request("POST", instance.url + endpoint, json=body, headers=headers,
                                                timeout=self.timeout)
            try:
                response = await self.client.send(request, stream=True)
            except httpx.ConnectError as exc:  # nothing reached D: another may take it
                instance.outstanding -= 1
                self.failed(instance, f"{type(exc).__name__}: {exc}")
                continue
            except httpx.HTTPError as exc:
                instance.outstanding -= 1
                self.failed(instance, f"{type(exc).__name__}: {exc}")
                return error(f"the decode server {instance.url} failed: {exc}", 502)
            if response.status_code >= 500:
                content = await response.aread()
                await response.aclose()
                instance.outstanding -= 1
                self.failed(instance, f"HTTP {response.status_code}: {content[:200]!r}")
                return error(f"the decode server {instance.url} failed with HTTP {response.status_code}: "
                             f"{content[:500].decode(errors='replace')}", 502)
            return instance, response


def build_proxy_app(prefill_urls: list[str], decode_urls: list[str], policy: str = "round_robin",
                    api_key: str | None = None, probe_interval_s: float = 5.0, timeout_s: float = 600.0) -> FastAPI:
    proxy = Proxy(InstancePool.of(prefill_urls, "prefill", policy), InstancePool.of(decode_urls, "decode", policy),
                  api_key, timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(limits=limits, timeout=proxy.timeout) as client:
            proxy.client = client
            prober = asyncio.create_task(_probe_forever(proxy, probe_interval_s))
            try:
                yield
            finally:
                prober.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await prober

    app = FastAPI(title="pd proxy", lifespan=lifespan)
    app.state.proxy = proxy

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _forward(proxy, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _forward(proxy, request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        for instance in [i for i in proxy.decode.instances if i.healthy] or proxy.decode.instances:
            try:
                response = await proxy.client.get(f"{instance.url}/v1/models",
                                                  headers=proxy.headers(request, "models"))
            except httpx.HTTPError:
                continue
            return Response(response.content, response.status_code, media_type="application/json")
        return error("no decode server answered /v1/models", 503, "service_unavailable")

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = any(i.healthy for i in proxy.prefill.instances) and any(i.healthy for i in proxy.decode.instances)
        body = {"status": "ok" if ok else "unavailable", "policy": policy,
                "prefill": [i.state() for i in proxy.prefill.instances],
                "decode": [i.state() for i in proxy.decode.instances]}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(proxy.registry), media_type=CONTENT_TYPE)

    return app


async def _probe_forever(proxy: Proxy, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        for pool in (proxy.prefill, proxy.decode):
            await pool.probe(proxy.client)


async def _forward(proxy: Proxy, request: Request, endpoint: str) -> Response:
    response = await _forward_once(proxy, request, endpoint)
    proxy.requests.labels(endpoint=endpoint, status=str(response.status_code)).inc()
    return response


async def _forward_once(proxy: Proxy, request: Request, endpoint: str) -> Response:
    try:
        body = json.loads(await request.body())
    except ValueError:
        return error("the request body is not valid JSON", 400, "invalid_request_error")
    if not isinstance(body, dict):
        return error("the request body must be a JSON object", 400, "invalid_request_error")
    request_id = request.headers.get("x-request-id") or f"pdx-{uuid.uuid4().hex}"
    headers = proxy.headers(request, request_id)
    key = prefix_key(body)
    params = await proxy.prefill_once(endpoint, body, headers, key)
    if isinstance(params, Response):
        return params
    opened = await proxy.open_decode(endpoint, body | {"kv_transfer_params": params}, headers, key)
    if isinstance(opened, Response):
        return opened
    instance, response = opened
    out_headers = {"X-Request-Id": request_id}
    if body.get("stream") and response.status_code == 200:
        return StreamingResponse(_relay(instance, response), media_type="text/event-stream",
                                 headers=out_headers | {"Cache-Control": "no-cache"})
    try:
        content = await _read_unless_disconnected(response, request)
    except httpx.HTTPError as exc:
        proxy.failed(instance, f"{type(exc).__name__}: {exc}")
        return error(f"the decode server {instance.url} failed: {exc}", 502)
    finally:
        await response.aclose()
        instance.outstanding -= 1
    if content is None:
        return Response(status_code=499)
    return Response(content, response.status_code, media_type="application/json", headers=out_headers)


async def _relay(instance: Instance, response: httpx.Response) -> AsyncIterator[bytes]:
    """D's stream, byte for byte; closing it (the client left) closes D's request."""
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:  # D died midway: end the stream with an error event
        logger.warning("decode server %s failed mid-stream: %s", instance.url, exc)
        instance.mark_failed(f"{type(exc).__name__}: {exc}")
        message = {"error": {"message": f"the decode server failed mid-stream: {exc}", "type": "bad_gateway",
                             "param": None, "code": 502}}
        yield f"data: {json.dumps(message)}\n\ndata: [DONE]\n\n".encode()
    finally:
        await response.aclose()
        instance.outstanding -= 1


async def _read_unless_disconnected(response: httpx.Response, request: Request) -> bytes | None:
    task = asyncio.ensure_future(response.aread())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await task
