"""What an operator sees of a process: its log lines (`logs`: text or JSON, each with the
request and trace it belongs to) and its spans (`tracing`: OpenTelemetry, off unless an
OTLP endpoint is given). It imports nothing of ours: `pd`, the proxy and the CLI use it."""
