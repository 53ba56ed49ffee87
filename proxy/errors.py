"""The proxy's error answers: OpenAI's `{"error": {...}}` (wire/errors.py, the same body
the servers answer with), and the exception that carries one from wherever a request is
refused to the app's handler."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from wire.errors import ApiError


def error_response(message: str, status: int, type: str = "bad_gateway", code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return ApiError(message, code=code, status=status, type=type, headers=headers).response()


class ProxyError(ApiError):
    """A request the proxy itself refuses (bad body, too large, no key); rendered by the
    app's exception handler as OpenAI's error object with `status`."""

    def __init__(self, message: str, code: str, status: int = 400, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message, code=code, status=status, param=param, headers=headers)
