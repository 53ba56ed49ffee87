"""The prefill and decode servers behind the proxy, and the three calls made to them:
prefill on a P, open the decode on a D, and release P's blocks when no D will read them.

What counts against an instance's circuit breaker (`breaker.py`): a transport failure
(cannot connect, timeout, connection broken), a 502 or 504 without a server's error code
(a gateway in front of it failed) and an error code "engine_dead" (503: its engine was
dead before the request reached it) or "engine_died" (it died serving the request); any
other answer is a success for the breaker.

A request is sent to another P (at most `max_retries` times, each after an exponential
backoff with jitter) when the failure is the instance's: it could not be reached
(nothing was sent), its engine was dead already (503 "engine_dead"), it holds too many
blocks for unread requests (503 "kv_held_limit") or it is draining (503
"server_draining": it did nothing of the request; a draining D is replaced the same
way, by another D reading P's blocks); once for a kept-alive connection closed
unanswered (`connections.py`); and, with migration on (`--migration-limit` > 0), when
the P that took it dropped the connection, timed out or its engine died serving it
("engine_died"): nothing has reached the client, and `max_retries` bounds the walk of a
request that is what kills servers. With `--migration-limit 0` such a request is not
tried on another: the client gets 502 or that answer, as for a P's 5xx of its own. A D
that took the request and then failed it (its connection broke, or "engine_died") is
`Broke`: the request is taken to another D (migration.py), at most `--migration-limit`
times. A 4xx is the server's verdict on this request, passed back as it is.

No room (every instance of a role at `max_outstanding`, or every P answering
kv_held_limit) is `NoRoom`: the request waits in the proxy's queue (`admission.py`) and
tries again as room frees up; only without a queue (`--max-queue 0`) is it answered at
once, 429 "overloaded" or the soonest kv_held_limit 503, with a Retry-After.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response

from proxy import spans
from proxy.admission import Admission
from proxy.answers import (
    OVERLOADED_RETRY_AFTER_S,
    backoff_s,
    cached_tokens,
    error_code,
    is_draining,
    is_server_failure,
    kv_held_response,
    overloaded_response,
    passed_back,
    retry_after_s,
)
from proxy.body import BodyError, parse_body, prefill_body, token_id_prompt
from proxy.breaker import Breaker
from proxy.calls import Broke, Call, NoRoom, Opened, Prefilled, TryAnother, Unreached
from proxy.canary import Canaries, check
from proxy.connections import ConnectionTrace
from proxy.errors import error_response
from proxy.fleet import Change, Fleet, allowed_networks
from proxy.instances import EmptyPoolError, Instance, InstancePool, NoInstanceError, OverloadedError
from proxy.metrics import ProxyMetrics
from proxy.proxy_config import ProxyConfig
from proxy.tap import Tap
from wire.codes import ENGINE_DEAD, ENGINE_DIED, KV_HELD_LIMIT, NO_INSTANCE
from wire.headers import PD_MIGRATABLE, REQUEST_ID, retry_after
from wire.kv_params import KV_TRANSFER_PARAMS, REMOTE_REQUEST_ID, SIGNATURE

logger = logging.getLogger(__name__)

RELEASE_PATH = "/v1/kv/release"
TOKENIZE_PATH = "/v1/tokenize"
TOKENIZE_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 5.0


class Upstream:
    """The instance pools, the HTTP client to them (set by the app's lifespan), metrics."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        breaker = (config.breaker_failures, config.breaker_cooldown_s)
        common = dict(tier_weights=config.kv_tier_weights, overlap_weight=config.kv_overlap_weight,
                      max_outstanding=config.max_outstanding, load_slack=config.load_slack)
        self.prefill = InstancePool.of(config.prefill_urls, "prefill", config.role_policy("prefill"), breaker, **common)
        self.decode = InstancePool.of(config.decode_urls, "decode", config.role_policy("decode"), breaker,
                                      decode_load_tokens=config.decode_load_tokens, **common)
        self.metrics = ProxyMetrics([self.prefill, self.decode])
        self.fleet = Fleet({"prefill": self.prefill, "decode": self.decode},
                           lambda url, role: Instance(url, role, Breaker(*breaker),
                                                      tier_weights=dict(config.kv_tier_weights)),
                           allowed_networks(config.fleet_allow),
                           on_change=self._fleet_changed)
        self.timeout, self.prefill_timeout, self.decode_timeout = (
            httpx.Timeout(s, connect=min(CONNECT_TIMEOUT_S, s))
            for s in (config.timeout_s, config.phase_timeout_s("prefill"), config.phase_timeout_s("decode")))
        self.client: httpx.AsyncClient | None = None
        self.arrivals = 0  # requests that reached the proxy (the planner's arrival rate)
        self.admission = Admission(config.max_queue, config.queue_timeout_s)
        self.metrics.queue_waiting.set_function(lambda: self.admission.num_waiting)
        self.canaries = Canaries(config.canary_fraction, config.canary_max_inflight, config.canary_tie_logprob,
                                 lambda result: self.metrics.canary.labels(result=result).inc())

    def _fleet_changed(self, change: Change) -> None:
        self.metrics.fleet_changes.labels(action=change.action).inc()
        self.admission.changed()  # a request waiting for room may find it on an instance that joined

    def canary(self, call: Call, tap: Tap, exclude: set[str]) -> Callable[[], Awaitable[str]]:
        """What runs `call`'s canary: alone on an instance (decode servers first) other than
        `exclude` (its P and D) where one is healthy and below --max-outstanding."""
        limit = self.config.max_outstanding
        fit = [i for i in self.decode.instances + self.prefill.instances
               if i.available and (not limit or i.in_flight < limit)]
        target = next((i for i in fit if i.url not in exclude), fit[0] if fit else None)
        parent = call.span  # its request's span, ended by the time the canary runs
        return lambda: check(self.client, call, tap, target, call.headers, self.timeout,
                             self.config.canary_tie_logprob, parent)

    def headers(self, request: Request, request_id: str) -> dict[str, str]:
        auth = self.config.server_authorization or request.headers.get("authorization")
        return {REQUEST_ID: request_id} | ({"Authorization": auth} if auth else {})

    async def tokenize(self, call: Call) -> list[int] | None:
        """The request's prompt tokens: a completion's token ids as they are (a server
        takes them so), else as a server tokenizes the body (`POST /v1/tokenize`, each
        server tried within `TOKENIZE_TIMEOUT_S`); None when no server could say (the
        request is then routed by load)."""
        ids = token_id_prompt(call.body)
        if ids is not None:
            return ids
        for instance in [i for i in self.decode.instances + self.prefill.instances if i.available]:
            try:
                response = await self.client.post(instance.url + TOKENIZE_PATH, json=call.body, headers=call.headers,
                                                  timeout=TOKENIZE_TIMEOUT_S)
                tokens = response.json().get("tokens") if response.status_code == 200 else None
            except (httpx.HTTPError, ValueError, AttributeError):
                continue
            if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
                return tokens
            return None  # the server refused the body: so will P
        return None

    def _note_pick(self, call: Call, pool: InstancePool, instance: Instance) -> None:
        call.note_pick(pool, instance)
        spans.routed(call, pool, instance)
        instance.expect(call.route)
        if call.route.tokens is not None and instance.block_size:
            self.metrics.routed_overlap.labels(role=instance.role).observe(
                call.picked[instance.role][1] // instance.block_size)

    def queue_refused(self, reason: str, exc: Exception) -> Response:
        """429 past the queue's bounds: full, or waited too long."""
        self.metrics.queue_refused.labels(reason=reason).inc()
        return error_response(f"{exc}; retry later", 429, "rate_limit_error", f"queue_{reason}",
                              retry_after(OVERLOADED_RETRY_AFTER_S))

    def refuse(self, no_room: NoRoom) -> Response:
        """The answer for a request that found no room and does not wait for it."""
        if no_room.overloaded is not None:
            self.metrics.overloaded.labels(role=no_room.overloaded).inc()
        return no_room.answer

    def failed(self, instance: Instance, why: str) -> None:
        if instance.mark_failed(why):
            logger.warning("%s server %s failed: %s; its breaker opened", instance.role, instance.url, why)
        else:
            logger.warning("%s server %s failed: %s", instance.role, instance.url, why)

    async def prefill_once(self, call: Call) -> Prefilled | NoRoom | Unreached | Response:
        """P's parameters from the first P that takes the request; NoRoom when every P is
        full or holds too many blocks for unread requests; Unreached when no P could be
        reached after `max_retries` tries, each after an exponential backoff with jitter;
        or the response for the client (a server's verdict, 502 for a P that failed
        serving it)."""
        tried: set[str] = set()
        held: list[float] = []  # Retry-After of each P that refused for kv_held_limit
        stale_retry = True  # one retry for a kept-alive connection closed unanswered
        for attempt in range(self.config.max_retries + 1):
            try:
                instance = self.prefill.pick(call.route, tried)
            except OverloadedError as exc:
                return NoRoom(overloaded_response(str(exc)), overloaded="prefill")
            except EmptyPoolError as exc:
                return Unreached(error_response(str(exc), 503, "service_unavailable", NO_INSTANCE))
            except NoInstanceError:
                break
            if attempt:
                self.metrics.retries.labels(role="prefill").inc()
                await asyncio.sleep(backoff_s(self.config.retry_backoff_s, attempt))
            tried.add(instance.url)
            self._note_pick(call, self.prefill, instance)
            answer = await self._prefill_at(instance, call, stale_retry)
            if not isinstance(answer, TryAnother):
                return answer
            stale_retry = stale_retry and not answer.stale
            if answer.retry_after_s is not None:
                held.append(answer.retry_after_s)
        if held:
            return NoRoom(kv_held_response(min(held)), min(held))
        return Unreached(error_response(f"no healthy prefill instance took the request after {len(tried)} tries",
                                        503, "service_unavailable"))

    async def _prefill_at(self, instance: Instance, call: Call, stale_retry: bool) -> Prefilled | Response | TryAnother:
        work = call.work_tokens(instance)
        instance.outstanding += 1
        instance.outstanding_tokens += work
        instance.requests += 1
        instance.breaker.start()
        trace = ConnectionTrace()  # whether a failure below was the keep-alive race
        span, headers = spans.calling(call, instance)
        status, error = None, "cancelled"
        try:
            response = await self.client.post(instance.url + call.endpoint, json=prefill_body(call.body, call.prefix),
                                              headers=headers, timeout=self.prefill_timeout,
                                              extensions={"trace": trace})
            status, error = response.status_code, None
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # nothing reached it
            error = type(exc).__name__
            self.failed(instance, f"{type(exc).__name__}: {exc}")
            return TryAnother()
        except httpx.TransportError as exc:  # it had the request: the request may be what failed it
            error = type(exc).__name__
            self.failed(instance, f"{type(exc).__name__}: {exc}")
            if trace.stale and stale_retry:  # unless the connection was closed under it
                return TryAnother(stale=True)
            if self.config.migration_limit > 0:  # nothing reached the client: another P may take it
                logger.warning("prefill server %s failed serving request %s (%s: %s); trying another", instance.url,
                               call.request_id, type(exc).__name__, exc)
                return TryAnother()
            return error_response(f"the prefill server {instance.url} failed while serving the request "
                                  f"({type(exc).__name__}: {exc}); it is not tried on another", 502)
        except httpx.HTTPError as exc:  # e.g. an undecodable content encoding: not the transport
            error = type(exc).__name__
            return error_response(f"the prefill server {instance.url} failed: {exc}", 502)
        finally:
            spans.called(span, status, error)
            instance.outstanding -= 1
            instance.outstanding_tokens -= work
            instance.breaker.finish()  # the verdict on it, if any, is given below
            self.admission.changed()
        if response.status_code == 200:
            instance.mark_succeeded()
            return self._prefilled(instance, response, call)
        if is_server_failure(response):
            self.failed(instance, f"HTTP {response.status_code}: {response.text[:200]}")
            died = error_code(response) == ENGINE_DIED and self.config.migration_limit > 0
            return TryAnother() if error_code(response) == ENGINE_DEAD or died else passed_back(instance, response)
        instance.mark_succeeded()  # it answered, whatever it answered
        if response.status_code == 503 and error_code(response) == KV_HELD_LIMIT:
            logger.info("prefill server %s holds too many blocks; trying another", instance.url)
            return TryAnother(retry_after_s(response))
        if is_draining(response):
            return TryAnother()  # it did nothing of the request
        return passed_back(instance, response)

    def _prefilled(self, instance: Instance, response: httpx.Response, call: Call) -> Prefilled | Response:
        try:
            answer = parse_body(response.content, self.config.max_depth)
        except BodyError as exc:
            return error_response(f"the prefill server {instance.url} answered 200, but {exc.message}", 502)
        params = answer.get(KV_TRANSFER_PARAMS)
        cached = cached_tokens(answer)
        if cached is not None:
            self.metrics.prefill_cached.observe(cached)
        if not isinstance(params, dict) or not params:
            return error_response(f"the prefill server {instance.url} kept no KV for the request "
                                  "(is it started with --kv-connector nixl?)", 502)
        return Prefilled(instance, params, reused=call.prefix is not None)

    async def open_decode(self, call: Call, first: Instance, params: dict[str, Any] | None,
                          body: dict[str, Any] | None = None,
                          tried: set[str] | None = None) -> Opened | Response | Broke:
        """D's 200 response, from `first` unless it is unhealthy by now, then from any
        other D (not in `tried`) while none could be reached (nothing was sent: another
        may take the same parameters; once also after a kept-alive connection closed
        unanswered); Broke when D took the request and failed it (migration.py); or the
        response for the client (D's verdict, 502, 503). Without P's `params`, D
        prefills the request itself. `body`: the call's own unless given (a migration's)."""
        body = call.body if body is None else body
        if params is not None:
            body = body | {KV_TRANSFER_PARAMS: params}
        if call.tap is not None:
            body = body | {"return_token_ids": True}  # what the tap reads (and takes out again)
        tried = set() if tried is None else tried
        instance, stale_retry = first, True
        while True:
            # it may have failed, begun to drain, or been given the prefill role while the request prefilled
            if instance.role == "decode" and not instance.draining and instance.breaker.allows():
                if tried:
                    self.metrics.retries.labels(role="decode").inc()
                tried.add(instance.url)
                self._note_pick(call, self.decode, instance)
                answer = await self._open_at(instance, call, body, stale_retry)
                if not isinstance(answer, TryAnother):
                    return answer
                stale_retry = stale_retry and not answer.stale
            try:
                instance = self.decode.pick(call.route, tried)
            except OverloadedError as exc:
                return self.refuse(NoRoom(overloaded_response(str(exc)), overloaded="decode"))
            except NoInstanceError as exc:
                return error_response(f"{exc}: cannot decode the request", 503, "service_unavailable",
                                      NO_INSTANCE if isinstance(exc, EmptyPoolError) else None)

    async def _open_at(self, instance: Instance, call: Call, body: dict[str, Any],
                       stale_retry: bool) -> Opened | Response | TryAnother | Broke:
        trace = ConnectionTrace()  # whether a failure below was the keep-alive race
        span, headers = spans.calling(call, instance)
        if call.tap is not None and call.tap.hold_errors:  # a draining D hands the stream on (migration.py)
            headers = headers | {PD_MIGRATABLE: "1"}
        request = self.client.build_request("POST", instance.url + call.endpoint, json=body, headers=headers,
                                            timeout=self.decode_timeout, extensions={"trace": trace})
        work = call.work_tokens(instance)
        instance.outstanding += 1
        instance.outstanding_tokens += work
        instance.requests += 1
        instance.breaker.start()
        call.unbind()  # outstanding somewhere now
        opened, status, error = None, None, "cancelled"
        try:
            response = await self.client.send(request, stream=True)
            status, error = response.status_code, None
            if response.status_code == 200:
                instance.mark_succeeded()
                opened = Opened(instance, response, work, self.admission.changed, span)
                self.admission.changed()  # D reads P's blocks now: P may take more
                return opened
            return await self._refused_by_decode(instance, response)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # nothing reached D
            error = type(exc).__name__
            self.failed(instance, f"{type(exc).__name__}: {exc}")
            return TryAnother()
        except httpx.HTTPError as exc:
            error = type(exc).__name__
            answer = error_response(f"the decode server {instance.url} failed: {exc}", 502)
            if isinstance(exc, httpx.TransportError):
                self.failed(instance, f"{type(exc).__name__}: {exc}")
                if trace.stale and stale_retry:  # the connection was closed under it: D never had it
                    return TryAnother(stale=True)
                return Broke(instance, "connection", answer)
            return answer
        finally:
            instance.breaker.finish()
            if opened is None:
                spans.called(span, status, error)
                instance.outstanding -= 1
                instance.outstanding_tokens -= work
                self.admission.changed()

    async def _refused_by_decode(self, instance: Instance, response: httpx.Response) -> Response | TryAnother | Broke:
        try:
            await response.aread()
        finally:
            await response.aclose()
        if is_draining(response):
            return TryAnother()  # it did nothing of the request: another D may read P's blocks
        if is_server_failure(response):
            self.failed(instance, f"HTTP {response.status_code}: {response.text[:200]}")
        else:
            instance.mark_succeeded()  # its verdict on this request
        if error_code(response) == ENGINE_DIED:
            return Broke(instance, ENGINE_DIED, passed_back(instance, response))
        return passed_back(instance, response)

    async def release(self, prefilled: Prefilled, headers: dict[str, str]) -> None:
        """Ask P to free the blocks it keeps for this request now, as no D will read them
        (else they stay held until their lease ends). Errors are logged and ignored."""
        remote_id = prefilled.params.get(REMOTE_REQUEST_ID)
        url = prefilled.instance.url + RELEASE_PATH
        try:
            if not isinstance(remote_id, str):
                raise ValueError(f"P's kv_transfer_params name no remote_request_id: {prefilled.params}")
            signature = prefilled.params.get(SIGNATURE)  # proves the proxy holds the parameters
            response = await self.client.post(url, json={REMOTE_REQUEST_ID: remote_id, SIGNATURE: signature},
                                              headers=headers, timeout=self.config.release_timeout_s)
            response.raise_for_status()
            result = "released" if response.json().get("released") is True else "unknown"
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            logger.warning("could not release %s on %s: %s: %s", remote_id, url, type(exc).__name__, exc)
            result = "failed"
        self.metrics.kv_releases.labels(result=result).inc()
        self.admission.changed()
