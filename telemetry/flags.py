"""The flags for logs and traces, the same on `pd serve` and `pd proxy`, and what they set up."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from telemetry import logs, tracing
from telemetry.logs import FORMATS

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_telemetry_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="log level (default info)")
    parser.add_argument("--log-format", choices=FORMATS, default="text",
                        help="log lines as text, or as JSON objects (one a line: time, level, logger, message, and "
                             "the request id and trace id where there is one) (default text)")
    parser.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                        help="export OpenTelemetry traces of every request over OTLP/HTTP to URL (e.g. "
                             "http://127.0.0.1:4318/v1/traces), continuing the W3C traceparent a request comes with; "
                             "needs pip install 'pd-serve[tracing]' (default: off)")


def apply_telemetry_flags(args: argparse.Namespace, prog: str, service: str, attributes: Mapping[str, str],
                          children: bool = False) -> None:
    """Logs and traces as the flags say (`children`: processes started from here log alike);
    SystemExit naming `prog` when tracing cannot be set up (the SDK missing, an endpoint
    that is not an http(s) URL)."""
    logs.configure(args.log_level, args.log_format, children=children)
    try:
        tracing.configure(service, args.otlp_traces_endpoint, attributes=attributes)
    except (ImportError, ValueError) as exc:
        raise SystemExit(f"{prog}: {exc}") from None
