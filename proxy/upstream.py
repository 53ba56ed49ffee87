"""The prefill and decode servers behind the proxy, and the three calls made to them:
prefill on a P, open the decode on a D, and release P's blocks when no D will read them.

Which answer marks an instance unhealthy (the prober brings it back when its /health
answers 200): a transport failure (cannot connect, timeout, connection broken) and a 503
whose error code is "engine_dead". Every other answer is the server's verdict on this
request, passed back to the client as it is (status and JSON body): a 4xx, and a 500 too
(the same content would fail on another server, so no other P is tried). A P that
refuses with 503 "kv_held_limit" (it holds too many blocks for unread requests) stays
healthy, and another P is tried; when none takes the request the client gets that 503
with a Retry-After.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from proxy.body import BodyError, parse_body
from proxy.config import ProxyConfig
from proxy.errors import error_response
from proxy.instances import Instance, InstancePool, NoInstanceError, Route
from proxy.metrics import ProxyMetrics

logger = logging.getLogger(__name__)

RELEASE_PATH = "/v1/kv/release"
TOKENIZE_PATH = "/v1/tokenize"
ENGINE_DEAD = "engine_dead"
KV_HELD_LIMIT = "kv_held_limit"
DEFAULT_RETRY_AFTER_S = 1.0
CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Call:
    """One client request as the proxy sends it on: the same endpoint, body, headers
    (X-Request-Id and Authorization) to P and D; `route` is what picking looks at.
    `picked` names, per role, the instance chosen and the prompt tokens it was expected
    to hold (answered in the X-PD-Prefill / X-PD-Decode headers)."""

    endpoint: str
    body: dict[str, Any]
    headers: dict[str, str]
    route: Route
    request_id: str
    picked: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True

    def work_tokens(self, instance: Instance) -> int:
        """The prompt tokens `instance` has to work through for it (compute on P, pull
        on D): those it does not hold already (0 when the prompt is not known)."""
        tokens = self.route.tokens
        return 0 if tokens is None else max(0, len(tokens) - instance.overlap_tokens(self.route))

    def note_pick(self, pool: InstancePool, instance: Instance) -> None:
        held = instance.overlap_tokens(self.route)
        self.picked[instance.role] = (pool.instances.index(instance), held)

    def route_headers(self) -> dict[str, str]:
        return {f"X-PD-{role.capitalize()}": f"{index}; overlap={held}" for role, (index, held) in self.picked.items()}


@dataclass(frozen=True)
class Prefilled:
    """P's answer: the instance that holds the request's blocks, and its kv_transfer_params."""

    instance: Instance
    params: dict[str, Any]


@dataclass
class Opened:
    """D's 200 response, headers read and body not yet; its instance counts it (and the
    prompt tokens it works through for it) outstanding until `close` (idempotent)."""

    instance: Instance
    response: httpx.Response
    work_tokens: int = 0
    closed: bool = field(default=False, repr=False)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.instance.outstanding -= 1
        self.instance.outstanding_tokens -= self.work_tokens
        await self.response.aclose()


@dataclass(frozen=True)
class TryAnother:
    """This P did not take the request and another may; `retry_after_s` when it
    refused for the KV it holds (otherwise it was marked unhealthy)."""

    retry_after_s: float | None = None


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body P gets: the client's, unstreamed, asking P to keep the blocks for D. P
    validates it exactly as D will (so a request D would refuse is refused before any
    prefill) and itself stops after the first token of a do_remote_decode request, so
    max_tokens, min_tokens, stream_options and the rest are sent as they are."""
    return body | {"stream": False, "kv_transfer_params": {"do_remote_decode": True}}


def error_code(response: httpx.Response) -> str | None:
    """The `error.code` of a server's JSON error body (read already), if it has one."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def retry_after_s(response: httpx.Response) -> float:
    try:
        seconds = float(response.headers.get("retry-after", ""))
    except ValueError:
        return DEFAULT_RETRY_AFTER_S
    return seconds if math.isfinite(seconds) and seconds >= 0 else DEFAULT_RETRY_AFTER_S


def passed_back(instance: Instance, response: httpx.Response) -> Response:
    """A server's answer (read already) for the client: its status and JSON body; a body
    that is not JSON is wrapped in an error object with the same status."""
    headers = {"Retry-After": response.headers["retry-after"]} if "retry-after" in response.headers else None
    try:
        response.json()
    except ValueError:
        return error_response(f"the {instance.role} server {instance.url} answered HTTP {response.status_code}: "
                              f"{response.text[:500]}", response.status_code, headers=headers)
    return Response(response.content, response.status_code, media_type="application/json", headers=headers)


class Upstream:
    """The instance pools, the HTTP client to them (set by the app's lifespan), metrics."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.prefill = InstancePool.of(config.prefill_urls, "prefill", config.prefill_policy,
                                       overlap_weight=config.kv_overlap_weight)
        self.decode = InstancePool.of(config.decode_urls, "decode", config.decode_policy,
                                      overlap_weight=config.kv_overlap_weight,
                                      decode_load_tokens=config.decode_load_tokens)
        self.metrics = ProxyMetrics([self.prefill, self.decode])
        self.timeout = httpx.Timeout(config.timeout_s, connect=min(CONNECT_TIMEOUT_S, config.timeout_s))
        self.client: httpx.AsyncClient | None = None

    def headers(self, request: Request, request_id: str) -> dict[str, str]:
        auth = self.config.server_authorization or request.headers.get("authorization")
        return {"X-Request-Id": request_id} | ({"Authorization": auth} if auth else {})

    async def tokenize(self, call: Call) -> list[int] | None:
        """The request's prompt tokens, as a server tokenizes it (`POST /v1/tokenize`);
        None when no server could say (the request is then routed by load)."""
        for instance in [i for i in self.decode.instances + self.prefill.instances if i.healthy]:
            try:
                response = await self.client.post(instance.url + TOKENIZE_PATH, json=call.body, headers=call.headers,
                                                  timeout=self.timeout)
                tokens = response.json().get("tokens") if response.status_code == 200 else None
            except (httpx.HTTPError, ValueError, AttributeError):
                continue
            if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
                return tokens
            return None  # the server refused the body: so will P
        return None

    def _note_pick(self, call: Call, pool: InstancePool, instance: Instance) -> None:
        call.note_pick(pool, instance)
        if call.route.tokens is not None and instance.block_size:
            self.metrics.routed_overlap.labels(role=instance.role).observe(
                call.picked[instance.role][1] // instance.block_size)

    def failed(self, instance: Instance, why: str) -> None:
        logger.warning("%s server %s failed: %s; marked unhealthy", instance.role, instance.url, why)
        instance.mark_failed(why)

    async def prefill_once(self, call: Call) -> Prefilled | Response:
        """P's parameters from the first P that takes the request, or the response for
        the client (a server's verdict, 503 when no P is left or every P holds too much)."""
        tried: set[str] = set()
        held: list[float] = []  # Retry-After of each P that refused for kv_held_limit
        while True:
            try:
                instance = self.prefill.pick(call.route, tried)
            except NoInstanceError as exc:
                return kv_held_response(min(held)) if held else error_response(
                    f"{exc}: cannot prefill the request", 503, "service_unavailable")
            tried.add(instance.url)
            self._note_pick(call, self.prefill, instance)
            answer = await self._prefill_at(instance, call)
            if not isinstance(answer, TryAnother):
                return answer
            if answer.retry_after_s is not None:
                held.append(answer.retry_after_s)

    async def _prefill_at(self, instance: Instance, call: Call) -> Prefilled | Response | TryAnother:
        work = call.work_tokens(instance)
        instance.outstanding += 1
        instance.outstanding_tokens += work
        instance.requests += 1
        try:
            response = await self.client.post(instance.url + call.endpoint, json=prefill_body(call.body),
                                              headers=call.headers, timeout=self.timeout)
        except httpx.TransportError as exc:
            self.failed(instance, f"{type(exc).__name__}: {exc}")
            return TryAnother()
        except httpx.HTTPError as exc:  # e.g. an undecodable content encoding: not the transport
            return error_response(f"the prefill server {instance.url} failed: {exc}", 502)
        finally:
            instance.outstanding -= 1
            instance.outstanding_tokens -= work
        if response.status_code == 200:
            return self._prefilled(instance, response)
        code = error_code(response)
        if response.status_code == 503 and code == ENGINE_DEAD:
            self.failed(instance, f"HTTP 503 {ENGINE_DEAD}: {response.text[:200]}")
            return TryAnother()
        if response.status_code == 503 and code == KV_HELD_LIMIT:
            logger.info("prefill server %s holds too many blocks; trying another", instance.url)
            return TryAnother(retry_after_s(response))
        return passed_back(instance, response)

    def _prefilled(self, instance: Instance, response: httpx.Response) -> Prefilled | Response:
        try:
            answer = parse_body(response.content, self.config.max_depth)
        except BodyError as exc:
            return error_response(f"the prefill server {instance.url} answered 200, but {exc.message}", 502)
        params = answer.get("kv_transfer_params")
        cached = _cached_tokens(answer)
        if cached is not None:
            self.metrics.prefill_cached.observe(cached)
        if not isinstance(params, dict) or not params:
            return error_response(f"the prefill server {instance.url} kept no KV for the request "
                                  "(is it started with --kv-connector nixl?)", 502)
        return Prefilled(instance, params)

    async def open_decode(self, call: Call, first: Instance, params: dict[str, Any]) -> Opened | Response:
        """D's 200 response, from `first` unless it is unhealthy by now, then from any
        other D while none could be reached (nothing was sent: another may take the same
        parameters); or the response for the client (D's verdict, 502, 503)."""
        body = call.body | {"kv_transfer_params": params}
        tried: set[str] = set()
        instance = first
        while True:
            if instance.healthy:  # it may have failed another request while this one prefilled
                tried.add(instance.url)
                self._note_pick(call, self.decode, instance)
                answer = await self._open_at(instance, call, body)
                if answer is not None:
                    return answer
            try:
                instance = self.decode.pick(call.route, tried)
            except NoInstanceError as exc:
                return error_response(f"{exc}: cannot decode the request", 503, "service_unavailable")

    async def _open_at(self, instance: Instance, call: Call, body: dict[str, Any]) -> Opened | Response | None:
        request = self.client.build_request("POST", instance.url + call.endpoint, json=body, headers=call.headers,
                                            timeout=self.timeout)
        work = call.work_tokens(instance)
        instance.outstanding += 1
        instance.outstanding_tokens += work
        instance.requests += 1
        opened = None
        try:
            response = await self.client.send(request, stream=True)
            if response.status_code == 200:
                opened = Opened(instance, response, work)
                return opened
            return await self._refused_by_decode(instance, response)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # nothing reached D
            self.failed(instance, f"{type(exc).__name__}: {exc}")
            return None
        except httpx.HTTPError as exc:
            if isinstance(exc, httpx.TransportError):
                self.failed(instance, f"{type(exc).__name__}: {exc}")
            return error_response(f"the decode server {instance.url} failed: {exc}", 502)
        finally:
            if opened is None:
                instance.outstanding -= 1
                instance.outstanding_tokens -= work

    async def _refused_by_decode(self, instance: Instance, response: httpx.Response) -> Response:
        try:
            await response.aread()
        finally:
            await response.aclose()
        if response.status_code == 503 and error_code(response) == ENGINE_DEAD:
            self.failed(instance, f"HTTP 503 {ENGINE_DEAD}: {response.text[:200]}")
        return passed_back(instance, response)

    async def release(self, prefilled: Prefilled, headers: dict[str, str]) -> None:
        """Ask P to free the blocks it keeps for this request now, as no D will read them
        (else they stay held until their lease ends). Errors are logged and ignored."""
        remote_id = prefilled.params.get("remote_request_id")
        url = prefilled.instance.url + RELEASE_PATH
        try:
            if not isinstance(remote_id, str):
                raise ValueError(f"P's kv_transfer_params name no remote_request_id: {prefilled.params}")
            response = await self.client.post(url, json={"remote_request_id": remote_id}, headers=headers,
                                              timeout=self.config.release_timeout_s)
            response.raise_for_status()
            result = "released" if response.json().get("released") is True else "unknown"
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            logger.warning("could not release %s on %s: %s: %s", remote_id, url, type(exc).__name__, exc)
            result = "failed"
        self.metrics.kv_releases.labels(result=result).inc()


def _cached_tokens(answer: dict[str, Any]) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` of a server's answer, if it says."""
    usage = answer.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) else None


def kv_held_response(retry_after: float) -> JSONResponse:
    return error_response("every prefill server holds too many KV blocks for requests not yet read; retry later",
                          503, "service_unavailable", KV_HELD_LIMIT, {"Retry-After": str(math.ceil(retry_after))})
