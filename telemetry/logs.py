"""Log lines as text (the default) or JSON (`--log-format json`: one object a line, for a
log collector), each naming the request it was written for and, with tracing on, its trace.

A request handler `bind`s its request id (and trace id) for the task serving it; every line
logged from that task, or from tasks it starts, carries them. uvicorn's own loggers write
through the same handler (`uvicorn_log_config`). A process started by `pd serve` (the
engine core) takes the format from the environment (`configure_from_env`).
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import time
from typing import Any

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ENV_FORMAT, ENV_LEVEL = "PD_LOG_FORMAT", "PD_LOG_LEVEL"  # read by child processes

_request: contextvars.ContextVar[tuple[str, str | None] | None] = contextvars.ContextVar("pd_request", default=None)


def bind(request_id: str, trace_id: str | None = None) -> contextvars.Token:
    """Name `request_id` (and `trace_id`) on every line logged from this task from now on."""
    return _request.set((request_id, trace_id))


def bound() -> tuple[str, str | None] | None:
    """The (request id, trace id) bound to this task, if any."""
    return _request.get()


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, and the
    request id and trace id where there are; an exception's traceback as `exc_info`."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage(),
            "pid": record.process}
        if (ids := _request.get()) is not None:
            line["request_id"] = ids[0]
            if ids[1] is not None:
                line["trace_id"] = ids[1]
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def configure(level: str = "info", fmt: str = "text", children: bool = False) -> None:
    """The root logger's one handler (stderr) at `level`, as `fmt` says; `children`: the
    processes this one starts log alike (through the environment)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    if children:
        os.environ[ENV_FORMAT], os.environ[ENV_LEVEL] = fmt, level


def configure_from_env() -> None:
    """In a child process: the format and level its parent set (nothing if it set none)."""
    fmt = os.environ.get(ENV_FORMAT)
    if fmt in FORMATS:
        configure(os.environ.get(ENV_LEVEL, "info"), fmt)


def uvicorn_log_config(fmt: str) -> dict[str, Any] | None:
    """uvicorn's `log_config`: its default for text; for JSON none of its own, so that its
    loggers (access lines too) write through the root logger's JSON handler."""
    if fmt == "text":
        from uvicorn.config import LOGGING_CONFIG

        return LOGGING_CONFIG
    return None
