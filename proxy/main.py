"""`pd proxy`: flags and the uvicorn server around `build_proxy_app`."""

from __future__ import annotations

import argparse
import logging

from proxy.instances import POLICIES

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_proxy_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                        help="prefill servers' base URLs, e.g. http://127.0.0.1:8100")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL",
                        help="decode servers' base URLs, e.g. http://127.0.0.1:8200")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default 8000)")
    parser.add_argument("--policy", choices=POLICIES, default="round_robin",
                        help="how a prefill and a decode server are picked per request: in turn, fewest "
                             "outstanding requests, or by prompt prefix (shared prefixes stay on one P and one D, "
                             "falling back to load when saturated) (default round_robin)")
    parser.add_argument("--api-key", default=None,
                        help="sent to the servers as 'Authorization: Bearer KEY' (default: the client's own header)")
    parser.add_argument("--probe-interval", type=float, default=5.0,
                        help="seconds between /health probes of every server; an unhealthy one returns when it "
                             "answers (default 5)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds a request to a server may take (default 600)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="log level (default info)")


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    from proxy.app import build_proxy_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.probe_interval <= 0 or args.timeout <= 0:
        raise SystemExit("pd proxy: --probe-interval and --timeout must be positive")
    app = build_proxy_app(args.prefill, args.decode, args.policy, args.api_key, args.probe_interval, args.timeout)
    print(f"pd proxy: {len(args.prefill)} prefill, {len(args.decode)} decode ({args.policy}) "
          f"at http://{args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
