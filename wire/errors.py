"""The one error shape both sides answer with, OpenAI's `{"error": {...}}`, and the
exception that carries it from wherever a request is refused to the app's handler
(starlette's JSONResponse: both apps are FastAPI's)."""

from __future__ import annotations

from typing import Any

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

INVALID_REQUEST_ERROR = "invalid_request_error"  # OpenAI's error type for a request refused as it is


def error_body(message: str, type: str = INVALID_REQUEST_ERROR, code: str | int | None = None,
               param: str | None = None) -> dict[str, dict[str, Any]]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ApiError(Exception):
    """A request refused with `status` and OpenAI's error object; an app renders it with
    `body()` and `headers`."""

    def __init__(self, message: str, *, code: str | None = None, status: int = 400,
                 type: str = INVALID_REQUEST_ERROR, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status
        self.type = type
        self.param = param
        self.headers = headers

    def body(self) -> dict[str, dict[str, Any]]:
        return error_body(self.message, self.type, self.code, self.param)

    @classmethod
    def of_http(cls, exc: HTTPException) -> ApiError:
        """Starlette's own refusal (an unknown route, a wrong method) in OpenAI's shape."""
        kind = "not_found_error" if exc.status_code == 404 else INVALID_REQUEST_ERROR
        return cls(str(exc.detail), status=exc.status_code, type=kind, headers=getattr(exc, "headers", None))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)
