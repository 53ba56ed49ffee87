"""`pd planner`: flags and the loop that observes the fleet, decides and acts.

Every `--interval` seconds: observe (`observe.py`), decide (`policy.py`), log the decision
as one JSON line with its reason and inputs, report it to the proxy (`POST
/admin/planner/decisions`: counted there, and shown on its dashboard) and, for a switch,
give the server its new role through the proxy's admin API. A tick that cannot observe
(the proxy or a server not answering) decides nothing and is logged.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import httpx

from planner.model import Costs
from planner.observe import Observer
from planner.policy import Decision, Planner, Slo
from telemetry.flags import add_telemetry_flags, apply_telemetry_flags
from wire.fleet import ADMIN_KEY_ENV, ADMIN_PATH, DECISIONS_PATH

logger = logging.getLogger("pd.planner")


def add_planner_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--proxy", required=True, metavar="URL", help="the proxy whose fleet is planned")
    parser.add_argument("--admin-key", default=None, metavar="KEY",
                        help=f"the proxy's admin key (default: ${ADMIN_KEY_ENV})")
    parser.add_argument("--ttft-slo", type=float, required=True, metavar="S",
                        help="time to first token the requests must get, at --percentile, in seconds")
    parser.add_argument("--tpot-slo", type=float, required=True, metavar="S",
                        help="time per output token the requests must get, in seconds")
    parser.add_argument("--percentile", type=float, default=90.0, metavar="P",
                        help="the TTFT percentile the SLO is about (default %(default)s)")
    parser.add_argument("--interval", type=float, default=2.0, metavar="S",
                        help="seconds between two looks at the fleet (default %(default)s)")
    parser.add_argument("--patience", type=int, default=2, metavar="N",
                        help="ticks in a row a move must be wanted before it is made (default %(default)s)")
    parser.add_argument("--cooldown", type=float, default=10.0, metavar="S",
                        help="seconds after a move before the next (default %(default)s)")
    parser.add_argument("--margin", type=float, default=0.2, metavar="F",
                        help="a split meeting the SLO is left only for one scoring this fraction better "
                             "(default %(default)s)")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=2000.0, metavar="R",
                        help="a prefill server's prompt tokens per second until measured (default %(default)s)")
    parser.add_argument("--decode-step", type=float, default=0.03, metavar="S",
                        help="a decode step's fixed seconds until measured (default %(default)s)")
    parser.add_argument("--decode-step-per-seq", type=float, default=0.002, metavar="S",
                        help="seconds each sequence adds to a decode step, until batches spread enough to fit it "
                             "(default %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="decide and log, change nothing")
    add_telemetry_flags(parser)


def run_planner(args: argparse.Namespace) -> int:
    apply_telemetry_flags(args, "pd planner", "pd-planner", {})
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request to each server, every tick
    admin_key = args.admin_key or os.environ.get(ADMIN_KEY_ENV)
    if not admin_key:
        raise SystemExit(f"pd planner: the proxy's admin key is needed (--admin-key or ${ADMIN_KEY_ENV})")
    try:
        slo = Slo(args.ttft_slo, args.tpot_slo, args.percentile / 100)
    except ValueError as exc:
        raise SystemExit(f"pd planner: {exc}") from None
    proxy = args.proxy.rstrip("/")
    observer = Observer(proxy, admin_key, Costs(args.prefill_tokens_per_s, args.decode_step,
                                                args.decode_step_per_seq))
    planner = Planner(slo, args.patience, args.cooldown, args.margin)
    headers = {"Authorization": f"Bearer {admin_key}"}
    logger.info("planning %s: TTFT p%g <= %g s, TPOT <= %g s, every %g s", proxy, args.percentile, args.ttft_slo,
                args.tpot_slo, args.interval)
    try:
        while True:
            tick(observer, planner, proxy, headers, args.dry_run)
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def tick(observer: Observer, planner: Planner, proxy: str, headers: dict[str, str], dry_run: bool) -> Decision | None:
    try:
        decision = planner.decide(*observer.observe())
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        logger.warning("cannot observe the fleet: %s: %s", type(exc).__name__, exc)
        return None
    logger.info("%s", json.dumps({"action": decision.action, "url": decision.url, "role": decision.role,
                                  "reason": decision.reason, "inputs": decision.inputs}))
    if dry_run or decision.action == "keep":
        return decision
    try:
        if decision.action == "switch":
            httpx.post(f"{proxy}{ADMIN_PATH}/role", headers=headers, timeout=10,
                       json={"url": decision.url, "role": decision.role, "reason": f"planner: {decision.reason}"}
                       ).raise_for_status()
        httpx.post(proxy + DECISIONS_PATH, headers=headers, timeout=10,
                   json={"action": decision.action, "url": decision.url, "role": decision.role,
                         "reason": decision.reason, "inputs": decision.inputs}).raise_for_status()
    except httpx.HTTPError as exc:
        logger.warning("the proxy did not take the decision: %s: %s", type(exc).__name__, exc)
    return decision
