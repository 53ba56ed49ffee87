"""What an operator sees of a process: its log lines (`logs`: text or JSON, each with the
request and trace it belongs to), its spans (`tracing`: OpenTelemetry, off unless an
OTLP endpoint is given) and the progress of its long work (`progress`: a bar on a
terminal, a few lines in a log). It imports nothing of ours: `pd`, the proxy, the CLI,
the benchmarks and deploy use it."""
