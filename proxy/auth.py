"""The proxy's key checks: a client's API key (every route but /health) and the admin key
(the fleet's admin API), both `Authorization: Bearer KEY`, compared in constant time."""

from __future__ import annotations

import hmac

from fastapi import Request

from proxy.errors import ProxyError


def require_key(request: Request, key: str, what: str = "API key", placeholder: str = "key",
                in_query: bool = False) -> None:
    """ProxyError 401 unless the request carries `key` as its Bearer token (`in_query`:
    or as `?key=KEY`, for a page a browser opens); `what` and `placeholder` name it in the
    message."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else None
    if given is None and in_query:
        given = request.query_params.get("key")
    if given is None or not hmac.compare_digest(given.encode("utf-8", "replace"), key.encode()):
        raise ProxyError(f"missing or incorrect {what} (send Authorization: Bearer <{placeholder}>)",
                         "invalid_api_key", status=401, headers={"WWW-Authenticate": "Bearer"})
