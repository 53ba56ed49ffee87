"""`pd planner`: flags and the loop that observes the fleet, decides and acts.

Every `--interval` seconds: observe (`observe.py`), decide (`policy.py`), log the decision
as one JSON line with its reason and inputs, report it to the proxy (`POST
/admin/planner/decisions`: counted there, and shown on its dashboard) and act on it:
- a switch: the server's new role, through the proxy's admin API;
- an add (`--launcher` and `--max-instances`): a new server from the launcher
  (`launchers.py`), which joins the proxy by itself;
- a remove: the server drained through the admin API (no new request reaches it), then
  stopped by the launcher (it finishes what it holds, then leaves).
A tick that cannot observe (the proxy or a server not answering) decides nothing and is
logged. With a launcher, `--start-prefill` / `--start-decode` servers are started first,
and on exit (SIGTERM, Ctrl-C) every server the launcher started is stopped.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import tempfile
import time
from pathlib import Path

import httpx

from launch.flags import non_negative_float, non_negative_int, positive_float, positive_int
from launch.signals import ignore_stop_signals, install_signal_handlers
from planner.launchers import Launcher, LauncherError, LocalLauncher, RayLauncher, with_launched
from planner.model import Costs
from planner.observe import Observer
from planner.policy import Decision, Planner, Scaling, Slo
from telemetry.flags import add_telemetry_flags, apply_telemetry_flags
from wire.fleet import ADMIN_KEY_ENV, ADMIN_PATH, DECISIONS_PATH

LAUNCHERS = ("none", "local", "ray")

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
    parser.add_argument("--load-window", type=non_negative_float, default=0.0, metavar="S",
                        help="plan for the arrival rate over the last S seconds (0, the default: since the last "
                             "tick, as an exponentially weighted mean); a window longer than the load's swings "
                             "keeps the split from chasing each one")
    parser.add_argument("--max-move", type=positive_int, default=None, metavar="N",
                        help="the most servers one switch moves (it moves half the way to the best split; "
                             "default: a quarter of the fleet, at least 1)")
    parser.add_argument("--dry-run", action="store_true", help="decide and log, change nothing")
    add_scaling_flags(parser)
    add_telemetry_flags(parser)


def add_scaling_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("scaling", "servers the planner starts and stops (planner/launchers.py)")
    group.add_argument("--launcher", choices=LAUNCHERS, default="none",
                       help="local: `pd serve` processes on this machine; ray: Ray actors on the cluster at "
                            "--ray-address; none: the planner only switches roles (default %(default)s)")
    group.add_argument("--model", default=None, metavar="PATH",
                       help="the model every server it starts serves (needed with --launcher)")
    group.add_argument("--serve-args", default="", metavar="FLAGS",
                       help="more `pd serve` flags for every server it starts, one string (e.g. '--num-threads 1')")
    group.add_argument("--start-prefill", type=non_negative_int, default=0, metavar="N",
                       help="prefill servers to start at the outset (default %(default)s)")
    group.add_argument("--start-decode", type=non_negative_int, default=0, metavar="N",
                       help="decode servers to start at the outset (default %(default)s)")
    group.add_argument("--min-instances", type=positive_int, default=2, metavar="N",
                       help="the fewest servers the planner shrinks the fleet to (default %(default)s)")
    group.add_argument("--max-instances", type=positive_int, default=None, metavar="N",
                       help="the most servers it grows the fleet to; without it the planner neither adds nor "
                            "stops servers")
    group.add_argument("--scale-down-after", type=non_negative_float, default=30.0, metavar="S",
                       help="seconds a smaller fleet must have been enough, without a break, before a server is "
                            "stopped (default %(default)s)")
    group.add_argument("--cpus-per-server", type=positive_float, default=1.0, metavar="N",
                       help="CPUs a server takes, per tensor-parallel rank: what Ray reserves for it, and what "
                            "--budget-cpus counts (default %(default)s)")
    group.add_argument("--tensor-parallel-size", type=positive_int, default=1, metavar="N",
                       help="tensor-parallel ranks of each server it starts (one GPU each, where Ray has GPUs; "
                            "default %(default)s)")
    group.add_argument("--budget-cpus", type=positive_float, default=None, metavar="N",
                       help="CPUs every server together may take: caps --max-instances (default: no cap)")
    group.add_argument("--budget-gpus", type=positive_int, default=None, metavar="N",
                       help="GPUs every server together may take, one per rank: caps --max-instances "
                            "(default: no cap)")
    group.add_argument("--ray-address", default=None, metavar="ADDR",
                       help="--launcher ray: the Ray cluster (e.g. auto, HOST:6379; default: a local one)")
    group.add_argument("--log-dir", type=Path, default=None, metavar="DIR",
                       help="where the servers' logs go (default $TMPDIR/pd-planner-<pid>)")


def scaling_of(args: argparse.Namespace) -> Scaling | None:
    """The bounds of the fleet's size (None: not the planner's to change); ValueError if
    they cannot hold."""
    if args.max_instances is None:
        return None
    if args.launcher == "none":
        raise ValueError("--max-instances needs a --launcher to start and stop servers")
    ranks = args.tensor_parallel_size
    caps = [args.max_instances]
    if args.budget_cpus is not None:
        caps.append(int(args.budget_cpus // (args.cpus_per_server * ranks)))
    if args.budget_gpus is not None:
        caps.append(args.budget_gpus // ranks)
    most = min(caps)
    if most < args.min_instances:
        raise ValueError(f"the budget holds {most} server(s), fewer than --min-instances {args.min_instances}")
    return Scaling(args.min_instances, most)


def make_launcher(args: argparse.Namespace, proxy: str) -> Launcher | None:
    if args.launcher == "none":
        if args.start_prefill or args.start_decode:
            raise ValueError("--start-prefill / --start-decode need a --launcher")
        return None
    if args.model is None:
        raise ValueError(f"--launcher {args.launcher} needs --model")
    serve_args = shlex.split(args.serve_args)
    log_dir = args.log_dir or Path(tempfile.gettempdir()) / f"pd-planner-{os.getpid()}"
    if args.launcher == "local":
        if args.tensor_parallel_size > 1:
            serve_args += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
        return LocalLauncher(proxy, args.model, serve_args, log_dir)
    return RayLauncher(proxy, args.model, serve_args, log_dir, args.ray_address,
                       args.cpus_per_server, args.tensor_parallel_size)


def run_planner(args: argparse.Namespace) -> int:
    apply_telemetry_flags(args, "pd planner", "pd-planner", {})
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request to each server, every tick
    admin_key = args.admin_key or os.environ.get(ADMIN_KEY_ENV)
    if not admin_key:
        raise SystemExit(f"pd planner: the proxy's admin key is needed (--admin-key or ${ADMIN_KEY_ENV})")
    proxy = args.proxy.rstrip("/")
    try:
        slo = Slo(args.ttft_slo, args.tpot_slo, args.percentile / 100)
        scaling = scaling_of(args)
        launcher = make_launcher(args, proxy)
    except (ValueError, LauncherError) as exc:
        raise SystemExit(f"pd planner: {exc}") from None
    observer = Observer(proxy, admin_key, Costs(args.prefill_tokens_per_s, args.decode_step,
                                                args.decode_step_per_seq), load_window_s=args.load_window)
    planner = Planner(slo, args.patience, args.cooldown, args.margin, scaling=scaling, max_move=args.max_move,
                      scale_down_after_s=args.scale_down_after)
    headers = {"Authorization": f"Bearer {admin_key}"}
    logger.info("planning %s: TTFT p%g <= %g s, TPOT <= %g s, every %g s%s", proxy, args.percentile, args.ttft_slo,
                args.tpot_slo, args.interval, "" if scaling is None else
                f"; {scaling.min_instances} to {scaling.max_instances} servers (--launcher {args.launcher})")
    install_signal_handlers()  # SIGTERM unwinds through the launcher's teardown
    try:
        for role, count in (("prefill", args.start_prefill), ("decode", args.start_decode)):
            for _ in range(count):
                launcher.start(role)
        while True:
            tick(observer, planner, proxy, headers, args.dry_run, launcher)
            time.sleep(args.interval)
    except (KeyboardInterrupt, SystemExit):
        return 0
    except LauncherError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        if launcher is not None:
            ignore_stop_signals()  # the teardown is bounded; a second signal must not orphan servers
            logger.info("stopping the %d server(s) the launcher started", len(launcher.stoppable()))
            launcher.close()


def tick(observer: Observer, planner: Planner, proxy: str, headers: dict[str, str], dry_run: bool,
         launcher: Launcher | None = None) -> Decision | None:
    try:
        members, load, costs = observer.observe()
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        logger.warning("cannot observe the fleet: %s: %s", type(exc).__name__, exc)
        return None
    for line in launcher.reap() if launcher is not None else ():
        logger.warning("%s", line)
    decision = planner.decide(with_launched(members, launcher), load, costs)
    logger.info("%s", json.dumps({"action": decision.action, "urls": decision.urls, "role": decision.role,
                                  "reason": decision.reason, "inputs": decision.inputs}))
    if dry_run or decision.action == "keep":
        return decision
    try:
        act(decision, proxy, headers, launcher)
        httpx.post(proxy + DECISIONS_PATH, headers=headers, timeout=10,
                   json={"action": decision.action, "url": decision.url, "role": decision.role,
                         "reason": _reported(decision), "inputs": decision.inputs}).raise_for_status()
    except httpx.HTTPError as exc:
        logger.warning("the proxy did not take the decision: %s: %s", type(exc).__name__, exc)
    except LauncherError as exc:
        logger.warning("the launcher did not start a server: %s", exc)
    return decision


def act(decision: Decision, proxy: str, headers: dict[str, str], launcher: Launcher | None) -> None:
    reason = f"planner: {decision.reason}"
    if decision.action == "switch":
        for url in decision.urls:
            httpx.post(f"{proxy}{ADMIN_PATH}/role", headers=headers, timeout=10,
                       json={"url": url, "role": decision.role, "reason": reason}).raise_for_status()
    elif decision.action == "add" and launcher is not None:
        launcher.start(decision.role)
    elif decision.action == "remove" and launcher is not None:
        for url in decision.urls:
            httpx.post(f"{proxy}{ADMIN_PATH}/drain", headers=headers, timeout=10,
                       json={"url": url, "reason": reason}).raise_for_status()
            launcher.stop(url)


def _reported(decision: Decision) -> str:
    """The reason as the proxy keeps it (a decision names one URL there: the others here)."""
    more = decision.urls[1:]
    return decision.reason if not more else f"{decision.reason}; moves {len(more) + 1} servers, also {', '.join(more)}"
