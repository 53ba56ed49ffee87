"""A request body read up to a size limit, never past it: the declared Content-Length is
checked before reading, and a chunked body stops being read at the limit."""

from __future__ import annotations

from starlette.requests import Request

from wire.codes import REQUEST_TOO_LARGE
from wire.errors import ApiError

DEFAULT_LIMIT = 4 * 1024 * 1024  # what the proxy and the servers read of a body by default (--max-request-bytes)


class BodyTooLarge(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is larger than the limit of {limit} bytes", code=REQUEST_TOO_LARGE,
                         status=413)
        self.limit = limit


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body; BodyTooLarge (413) as soon as it is known to be past `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)
