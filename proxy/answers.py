"""What the servers answer the proxy, read: an error's code, a Retry-After, a server's
answer passed back to the client; and the answers the proxy itself gives when it
cannot place a request (429 overloaded, 503 every P holds too much), with the backoff
between retries.
"""

from __future__ import annotations

import math
import random
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response

from proxy.errors import error_response
from proxy.instances import Instance
from wire.codes import ENGINE_DEAD, ENGINE_DIED, KV_HELD_LIMIT, OVERLOADED, SERVER_DRAINING
from wire.headers import RETRY_AFTER, retry_after

GATEWAY_FAILURES = (502, 504)  # without a server's error code: a gateway in front of it failed
DEFAULT_RETRY_AFTER_S = 1.0
OVERLOADED_RETRY_AFTER_S = 1
MAX_BACKOFF_S = 5.0


def error_code(response: httpx.Response) -> str | None:
    """The `error.code` of a server's JSON error body (read already), if it has one."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None

def is_server_failure(response: httpx.Response) -> bool:
    """Whether an answer (read already) says the server failed, not that it refuses this
    request: its engine is or went dead, or a gateway in front of it answered 502 or 504
    (a server's own 502, e.g. "kv_load_failed", names its error code)."""
    code = error_code(response)
    return code in (ENGINE_DEAD, ENGINE_DIED) or (response.status_code in GATEWAY_FAILURES and code is None)


def is_draining(response: httpx.Response) -> bool:
    """Whether an answer (read already) says the server is draining: it did nothing of the
    request, which another server may take."""
    return response.status_code == 503 and error_code(response) == SERVER_DRAINING


def retry_after_s(response: httpx.Response) -> float:
    try:
        seconds = float(response.headers.get(RETRY_AFTER, ""))
    except ValueError:
        return DEFAULT_RETRY_AFTER_S
    return seconds if math.isfinite(seconds) and seconds >= 0 else DEFAULT_RETRY_AFTER_S

def passed_back(instance: Instance, response: httpx.Response) -> Response:
    """A server's answer (read already) for the client: its status and JSON body; a body
    that is not JSON is wrapped in an error object with the same status."""
    headers = {RETRY_AFTER: response.headers[RETRY_AFTER]} if RETRY_AFTER in response.headers else None
    try:
        response.json()
    except ValueError:
        return error_response(f"the {instance.role} server {instance.url} answered HTTP {response.status_code}: "
                              f"{response.text[:500]}", response.status_code, headers=headers)
    return Response(response.content, response.status_code, media_type="application/json", headers=headers)

def cached_tokens(answer: dict[str, Any]) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` of a server's answer, if it says."""
    usage = answer.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) else None

def backoff_s(base_s: float, attempt: int) -> float:
    """The wait before retry `attempt` (1, 2, ...): base x 2^(attempt-1), times a random
    factor in [1, 2) so that requests failing together do not retry together."""
    return min(MAX_BACKOFF_S, base_s * 2 ** (attempt - 1) * (1 + random.random()))

def overloaded_response(why: str) -> JSONResponse:
    return error_response(f"{why}: the proxy is at its --max-outstanding; retry later", 429, "rate_limit_error",
                          OVERLOADED, retry_after(OVERLOADED_RETRY_AFTER_S))

def kv_held_response(wait_s: float) -> JSONResponse:
    return error_response("every prefill server holds too many KV blocks for requests not yet read; retry later",
                          503, "service_unavailable", KV_HELD_LIMIT, retry_after(wait_s))
