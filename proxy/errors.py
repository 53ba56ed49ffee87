"""The one error shape the proxy answers with (OpenAI's `{"error": {...}}`), and the
exception that carries it from wherever a request is refused to the app's handler."""

from __future__ import annotations

from fastapi.responses import JSONResponse


def error_body(message: str, type: str, code: str | None = None,
               param: str | None = None) -> dict[str, dict[str, str | None]]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(message: str, status: int, type: str = "bad_gateway", code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, code), status_code=status, headers=headers)


class ProxyError(Exception):
    """A request the proxy itself refuses (bad body, too large, no key); rendered by the
    app's exception handler as OpenAI's error object with `status`."""

    def __init__(self, message: str, code: str, status: int = 400, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status
        self.param = param
        self.headers = headers

    def response(self) -> JSONResponse:
        body = error_body(self.message, "invalid_request_error", self.code, self.param)
        return JSONResponse(body, status_code=self.status, headers=self.headers)
