"""The flags for logs and traces, the same on `pd serve` and `pd proxy`."""

from __future__ import annotations

import argparse

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
