"""`pd proxy`: flags and the uvicorn server around `build_proxy_app`."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from launch.ports import listen
from proxy.disagg import DISAGG_POLICIES
from proxy.fleet import FLEET_ALLOW
from proxy.instances import POLICIES
from proxy.proxy_config import PROXY_DEFAULTS, ProxyConfig, tier_weights
from telemetry import logs, tracing
from telemetry.flags import add_telemetry_flags, apply_telemetry_flags
from wire.fleet import ADMIN_KEY_ENV, SECRET_ENV


def add_proxy_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="URL",
                        help="prefill servers' base URLs, e.g. http://127.0.0.1:8100 (the flag may be repeated: "
                             "each adds its URLs; a URL given twice is refused). With neither --prefill nor "
                             "--decode the fleet starts empty (requests get 503 no_instance) and servers join "
                             "through the admin API or --register (default: none)")
    parser.add_argument("--decode", nargs="+", action="extend", default=[], metavar="URL",
                        help="decode servers' base URLs, e.g. http://127.0.0.1:8200 (the flag may be repeated: "
                             "each adds its URLs; a URL given twice is refused) (default: none)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on; 0: any free one, as the kernel "
                                                               "picks it when the proxy binds (default 8000)")
    parser.add_argument("--port-file", type=Path, default=None, metavar="PATH",
                        help="write the port listened on to PATH as soon as it is bound (with --port 0, the only "
                             "way to learn it; a launcher waits for it) (default: none)")
    _add_routing_flags(parser)
    _add_fleet_flags(parser)
    _add_fault_flags(parser)
    _add_canary_flags(parser)
    add_telemetry_flags(parser)


def _add_routing_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", choices=POLICIES, default=PROXY_DEFAULTS["policy"],
                        help="how a prefill and a decode server are picked per request: in turn, fewest "
                             "outstanding requests, by prompt prefix (shared prefixes stay on one P and one D, "
                             "falling back to load when saturated), or kv_aware: by the blocks each server's KV "
                             "events say it holds (servers started with --kv-events-port) against its load "
                             "(default %(default)s)")
    parser.add_argument("--prefill-policy", choices=POLICIES, default=None,
                        help="the policy for prefill servers (default: --policy)")
    parser.add_argument("--decode-policy", choices=POLICIES, default=None,
                        help="the policy for decode servers, which pull only the blocks they lack (default: --policy; "
                             "kv_aware under --disagg-policy conditional, so that a conversation's next turn goes "
                             "to the decode server holding its last one)")
    parser.add_argument("--kv-overlap-weight", type=float, default=PROXY_DEFAULTS["kv_overlap_weight"],
                        help="kv_aware: what one prompt token a server holds is worth against one token of its "
                             "load (prompt tokens of requests in flight it still works through) (default %(default)s)")
    parser.add_argument("--kv-tier-weights", default="device=1,host=0.8,disk=0.5", metavar="MEDIUM=W,...",
                        help="kv_aware: what a prompt block a server holds is worth by where it holds it, its KV "
                             "cache (device) or an offload tier (host, disk: read back before use); a block in "
                             "several counts for the best (default %(default)s)")
    parser.add_argument("--decode-load-tokens", type=int, default=PROXY_DEFAULTS["decode_load_tokens"],
                        help="kv_aware: the load, in tokens, one request a decode server is decoding counts for "
                             "(default %(default)s)")
    parser.add_argument("--load-slack", type=int, default=PROXY_DEFAULTS["load_slack"], metavar="N",
                        help="prefix_aware and kv_aware: a server with more than N requests in flight above the "
                             "least loaded one is passed over, whatever it holds (default %(default)s)")
    parser.add_argument("--disagg-policy", choices=DISAGG_POLICIES, default=PROXY_DEFAULTS["disagg_policy"],
                        help="always: every prompt is computed on a prefill server; conditional: the decode server "
                             "computes it itself when it lacks at most --local-prefill-max-tokens of it (by its KV "
                             "events: start decode servers with --kv-events-port), when the least loaded prefill "
                             "server has more prompt tokens queued than the decode server lacks, or when no prefill "
                             "server is healthy or reachable (default %(default)s)")
    parser.add_argument("--local-prefill-max-tokens", type=int, default=PROXY_DEFAULTS["local_prefill_max_tokens"],
                        metavar="N", help="conditional: the most prompt tokens a decode server computes itself for "
                                          "a request (default %(default)s)")
    parser.add_argument("--reuse-min-tokens", type=int, default=PROXY_DEFAULTS["reuse_min_tokens"], metavar="N",
                        help="conditional: when a request goes to a prefill server and its decode server holds at "
                             "least N more of the prompt than any prefill server is known to (an earlier turn and "
                             "its answer), the prefill server reads that prefix from the decode server instead of "
                             "computing it; 0 never (default %(default)s)")


def _add_fleet_flags(parser: argparse.ArgumentParser) -> None:
    """Instances joining and leaving at runtime (proxy/fleet.py, proxy/fleet_api.py)."""
    group = parser.add_argument_group("fleet", "instances that join, drain, leave and switch roles at runtime")
    group.add_argument("--admin-key", default=None, metavar="KEY",
                       help="turns on the admin API (/admin/instances: list, add, drain, remove, switch roles), "
                            "which then needs 'Authorization: Bearer KEY' (else 401); prefer the "
                            f"{ADMIN_KEY_ENV} environment variable, which other users cannot read in the process "
                            "list (default: the admin API is off, 403)")
    group.add_argument("--fleet-secret", default=None, metavar="SECRET",
                       help="the secret servers started with --register sign their registration with: the "
                            f"deployment's, {SECRET_ENV}, which is also the default (default: that variable; "
                            "without it registration is off, 403)")
    group.add_argument("--fleet-allow", nargs="+", default=list(FLEET_ALLOW), metavar="CIDR",
                       help="networks a registration may come from, and that an instance's address (registered "
                            "or added) must be in; anything else is refused with 403 (default: %(default)s)")


def _add_fault_flags(parser: argparse.ArgumentParser) -> None:
    """Access, limits, timeouts, retries and circuit breakers."""
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="clients must send 'Authorization: Bearer KEY' on every route but /health (else 401); "
                             "also what is sent to the servers unless --server-api-key is given (default: no check)")
    parser.add_argument("--server-api-key", default=None, metavar="KEY",
                        help="sent to the prefill and decode servers as 'Authorization: Bearer KEY' (default: "
                             "--api-key; with neither, the client's own Authorization header is passed on)")
    parser.add_argument("--max-request-bytes", type=int, default=PROXY_DEFAULTS["max_request_bytes"], metavar="N",
                        help="largest request body accepted, in bytes; a larger one is refused with 413 (checked "
                             "against Content-Length, and while reading a chunked body) (default %(default)s)")
    parser.add_argument("--probe-interval", type=float, default=PROXY_DEFAULTS["probe_interval_s"],
                        help="seconds between /health probes of every server; a server whose breaker is open "
                             "is probed once its cool-down is over, and taken again when it answers "
                             "(default %(default)s)")
    parser.add_argument("--timeout", type=float, default=PROXY_DEFAULTS["timeout_s"],
                        help="seconds a request to a server may take (default %(default)s)")
    parser.add_argument("--prefill-timeout", type=float, default=None, metavar="S",
                        help="seconds a prefill server may take to answer; past it the request is retried on "
                             "another (default: --timeout)")
    parser.add_argument("--decode-timeout", type=float, default=None, metavar="S",
                        help="seconds a decode server may take to send its headers, or the next piece of its "
                             "answer (default: --timeout)")
    parser.add_argument("--max-retries", type=int, default=PROXY_DEFAULTS["max_retries"], metavar="N",
                        help="other prefill servers a request is sent to after one did not take it (no connection, "
                             "timeout, 5xx, dead engine, too many blocks held); 0: none (default %(default)s)")
    parser.add_argument("--migration-limit", type=int, default=PROXY_DEFAULTS["migration_limit"], metavar="N",
                        help="times a request is resumed on another decode server after its own failed midway "
                             "(connection lost, engine died): a stream goes on from the tokens it had, an "
                             "unstreamed request is run again; 0: never (default %(default)s)")
    parser.add_argument("--retry-backoff", type=float, default=PROXY_DEFAULTS["retry_backoff_s"], metavar="S",
                        help="seconds before the first retry, doubled for each next one, times a random factor "
                             "in [1, 2) (default %(default)s)")
    parser.add_argument("--breaker-failures", type=int, default=PROXY_DEFAULTS["breaker_failures"], metavar="N",
                        help="failures in a row (no connection, timeout, 502/504, dead engine) that open a "
                             "server's circuit breaker: nothing is sent to it until a trial succeeds "
                             "(default %(default)s)")
    parser.add_argument("--breaker-cooldown", type=float, default=PROXY_DEFAULTS["breaker_cooldown_s"], metavar="S",
                        help="seconds an open breaker waits before one trial (a request, or the /health probe) "
                             "may go; success closes it (default %(default)s)")
    parser.add_argument("--max-outstanding", type=int, default=PROXY_DEFAULTS["max_outstanding"], metavar="N",
                        help="requests in flight one server takes at most; when every server of a role has "
                             "that many, the request waits in the queue (--max-queue) (default 0: no limit)")
    parser.add_argument("--max-queue", type=int, default=PROXY_DEFAULTS["max_queue"], metavar="N",
                        help="requests that wait for room at most (every server at --max-outstanding, or every "
                             "prefill server holding too many blocks for unread requests), served in order of "
                             "their body's priority (lower first) then arrival; past it the client gets 429 with "
                             "Retry-After; 0: no queue, no room is answered at once (default %(default)s)")
    parser.add_argument("--max-client-priority", type=int, default=PROXY_DEFAULTS["max_client_priority"],
                        metavar="P", help="the most urgent priority a client may ask in its body (lower is served "
                                          "first); a lower one is refused with 400. The default lets a client "
                                          "defer its own requests (priority > 0) but not go ahead of others; "
                                          "-2147483648 lets any client ask anything (default %(default)s)")
    parser.add_argument("--queue-timeout", type=float, default=PROXY_DEFAULTS["queue_timeout_s"], metavar="S",
                        help="the longest a request waits in the queue; then 429 with Retry-After "
                             "(default %(default)s)")


def _add_canary_flags(parser: argparse.ArgumentParser) -> None:
    """The canary: PD answers checked against colocated ones."""
    parser.add_argument("--canary-fraction", type=float, default=PROXY_DEFAULTS["canary_fraction"], metavar="F",
                        help="a fraction (0-1) of the greedy or seeded one-sequence requests that take a PD path "
                             "is also run alone on another server once its answer is sent, and the token ids "
                             "compared: pd_proxy_canary_total{result=match|tie|mismatch|error|skipped}, a mismatch "
                             "logged with both request ids and on the request's trace (default %(default)s: off)")
    parser.add_argument("--canary-max-inflight", type=int, default=PROXY_DEFAULTS["canary_max_inflight"],
                        metavar="N", help="canaries running at once at most; an answer ending past it is "
                                          "counted skipped (default %(default)s)")
    parser.add_argument("--canary-tie-logprob", type=float, default=PROXY_DEFAULTS["canary_tie_logprob"],
                        metavar="EPS", help="answers that differ first at a token that is one of the colocated "
                                            "answer's two most likely there, within EPS of its logprob, are a tie "
                                            "(arithmetic that differs in its last bits may pick either), not a "
                                            "mismatch (default %(default)s)")


def proxy_config(args: argparse.Namespace) -> ProxyConfig:
    """The config the flags describe; SystemExit naming the problem if they are invalid."""
    try:
        return ProxyConfig(tuple(args.prefill), tuple(args.decode), args.policy, args.prefill_policy,
                           args.decode_policy, args.kv_overlap_weight, args.decode_load_tokens, args.load_slack,
                           api_key=args.api_key,
                           server_api_key=args.server_api_key, probe_interval_s=args.probe_interval,
                           timeout_s=args.timeout, prefill_timeout_s=args.prefill_timeout,
                           decode_timeout_s=args.decode_timeout, max_retries=args.max_retries,
                           migration_limit=args.migration_limit,
                           retry_backoff_s=args.retry_backoff, breaker_failures=args.breaker_failures,
                           breaker_cooldown_s=args.breaker_cooldown, max_outstanding=args.max_outstanding,
                           max_queue=args.max_queue, queue_timeout_s=args.queue_timeout,
                           max_client_priority=args.max_client_priority, canary_fraction=args.canary_fraction,
                           canary_max_inflight=args.canary_max_inflight, canary_tie_logprob=args.canary_tie_logprob,
                           max_request_bytes=args.max_request_bytes, disagg_policy=args.disagg_policy,
                           local_prefill_max_tokens=args.local_prefill_max_tokens,
                           reuse_min_tokens=args.reuse_min_tokens, kv_tier_weights=tier_weights(args.kv_tier_weights),
                           admin_key=args.admin_key or os.environ.get(ADMIN_KEY_ENV) or None,
                           fleet_secret=args.fleet_secret or os.environ.get(SECRET_ENV) or None,
                           fleet_allow=tuple(args.fleet_allow))
    except ValueError as exc:
        raise SystemExit(f"pd proxy: {exc}") from None


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    from proxy.app import SERVER_KEEPALIVE_S, build_proxy_app
    from proxy.dashboard import RedactKey

    config = proxy_config(args)
    try:
        listener = listen(args.host, args.port, args.port_file)
    except OSError as exc:
        raise SystemExit(f"pd proxy: cannot listen on {args.host}:{args.port}: {exc}") from None
    args.port = listener.getsockname()[1]  # the one bound: --port 0 asks the kernel
    apply_telemetry_flags(args, "pd proxy", "pd-proxy", {"pd.instance": f"{args.host}:{args.port}"})
    logging.getLogger("uvicorn.access").addFilter(RedactKey())  # /dashboard?key=KEY
    app = build_proxy_app(config)
    logging.getLogger("pd.proxy").info("%d prefill (%s), %d decode (%s), disaggregation %s at http://%s:%d",
                                       len(args.prefill), config.role_policy("prefill"), len(args.decode),
                                       config.role_policy("decode"), config.disagg_policy, args.host, args.port)
    logging.getLogger("pd.proxy").info("admin API %s; registration %s (from %s)",
                                       "on" if config.admin_key else "off (no --admin-key)",
                                       "on" if config.fleet_secret else "off (no --fleet-secret)",
                                       ", ".join(config.fleet_allow))
    try:
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                               log_config=logs.uvicorn_log_config(args.log_format),
                                               timeout_keep_alive=SERVER_KEEPALIVE_S))
        server.run(sockets=[listener])
    finally:
        tracing.shutdown()  # what is still queued goes out
    return 0
