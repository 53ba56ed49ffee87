"""`pd bench simulate`: a discrete-event model of a PD fleet, to plan beyond this machine.

The fleet (`benchmarks/sim/`): N instances, each one engine stepping as the real
scheduler does with step costs fitted from the real engine (`fit`); the proxy's own
pools, picks and disaggregation policy; KV reads; and the real `pd planner` (its
observer and policy) ticking on the simulated clock. The load: `pd bench fleet`'s phases
(the same arrivals for a seed) or a trace in Mooncake's format at any speed. The figures
per configuration and phase are pd bench fleet's (goodput, SLO attainment, TTFT and TPOT
percentiles), in its table, JSON and plot.

    pd bench simulate fit --model M.gguf --output costs.json      # measure the engine (1 thread)
    pd bench simulate run --costs costs.json --servers 32 --trace T.jsonl --trace-phases "a:seconds=60;..."
    pd bench simulate validate --costs costs.json --fleet results/fleet-X/fleet.json
    pd bench simulate trace --costs costs.json --servers 32 --phases "a:seconds=60,load=0.7,input=512,output=64"

Configurations: `KpMd` (static, every prompt on a P), `colocated` (each server prefills
and decodes its own requests), `conditional` (1P(N-1)D under the proxy's conditional
disaggregation) or `conditional-KpMd`, and `planner` (from 1P(N-1)D, as pd bench fleet).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from benchmarks import fleet
from benchmarks.sim import fit as fitting
from benchmarks.sim import planning, trace
from benchmarks.sim.costs import StepCosts
from benchmarks.sim.engine import SimEngine
from benchmarks.sim.fleet import SimRequest, Simulation, Tick
from benchmarks.sim.proxy import SimProxy
from proxy.disagg import LOCAL_PREFILL_MAX_TOKENS
from proxy.instances import POLICIES
from proxy.proxy_config import PROXY_DEFAULTS, ProxyConfig

UNLIMITED = 1 << 30  # colocated: D computes every prompt itself


def fleet_requests(phases: list[fleet.Phase], seed: int) -> list[SimRequest]:
    """pd bench fleet's arrivals for `seed`: the same times and lengths its client sends."""
    samples, offsets, names = fleet.workload(phases, seed, 32000)
    return [SimRequest(t, s.prompt_len, s.output_len, name) for s, t, name in zip(samples, offsets, names)]


def config_setup(config: str, n: int, planner_start: str | None = None) -> tuple[list[str], str, int]:
    """(each server's first role, the disaggregation policy, the local prefill limit)."""
    if config == "planner" and planner_start:
        return fleet.initial_roles(planner_start, n), "always", LOCAL_PREFILL_MAX_TOKENS
    if config == "colocated":
        return ["decode"] * n, "conditional", UNLIMITED
    if config.startswith("conditional"):
        split = config.partition("-")[2] or f"1p{n - 1}d"
        return fleet.initial_roles(split, n), "conditional", LOCAL_PREFILL_MAX_TOKENS
    return fleet.initial_roles(config, n), "always", LOCAL_PREFILL_MAX_TOKENS


def simulate(config: str, requests: list[SimRequest], costs: StepCosts, args: argparse.Namespace) -> dict:
    """One configuration's run: its records and the planner's switches and decisions."""
    roles, policy, local_max = config_setup(config, args.servers, getattr(args, "planner_start", None))
    urls = [f"http://sim-{i}" for i in range(args.servers)]
    proxy = SimProxy(ProxyConfig(tuple(u for u, r in zip(urls, roles) if r == "prefill"),
                                 tuple(u for u, r in zip(urls, roles) if r == "decode"), disagg_policy=policy,
                                 policy=getattr(args, "policy", PROXY_DEFAULTS["policy"]),
                                 local_prefill_max_tokens=local_max, admin_key="simulated"))
    engines = {url: SimEngine(costs) for url in urls}
    fresh = [SimRequest(r.arrival, r.prompt, r.output, r.phase) for r in requests]
    sim = Simulation(costs, proxy, engines, fresh, one_host=getattr(args, "one_host", False))
    decisions: list[dict] = []
    if config == "planner":
        pargs = planning.planner_args(args.planner_args, args.ttft_slo, args.tpot_slo)
        observer, planner = planning.build(pargs, proxy, engines, lambda: sim.now)

        def decide(now: float) -> list[tuple[str, str]]:
            decision = planner.decide(*observer.observe())
            if decision.action != "keep":
                decisions.append({"at_s": round(now, 3), "action": decision.action, "urls": list(decision.urls),
                                  "role": decision.role, "reason": decision.reason})
            return [(url, decision.role) for url in decision.urls] if decision.action == "switch" else []

        sim.tick = Tick(pargs.interval, decide, args.switch_delay)
    sim.run(max(r.arrival for r in fresh) + args.request_timeout)
    return {"records": [r.record(args.request_timeout) for r in fresh], "names": [r.phase for r in fresh],
            "switches": sim.switches, "decisions": decisions}


def configs_of(args: argparse.Namespace) -> list[str]:
    statics = [f"{k}p{args.servers - k}d" for k in range(1, args.servers)]
    if not args.configs:
        return ["planner", "colocated", "conditional", *statics]
    asked = [c.strip() for c in args.configs.split(",") if c.strip()]
    known = ("planner", "colocated", "conditional", *statics, *(f"conditional-{s}" for s in statics))
    unknown = [c for c in asked if c not in known]
    if unknown:
        raise ValueError(f"unknown configuration(s) {', '.join(unknown)}: planner, colocated, conditional, "
                         f"conditional-KpMd, KpMd with K + M = {args.servers}")
    return asked


def workload_of(args: argparse.Namespace) -> tuple[list[SimRequest], list[fleet.Phase], str]:
    if args.trace:
        requests, phases = trace.trace_requests(args.trace, args.trace_phases, args.speed)
        return requests, phases, f"trace {args.trace.name} x{args.speed:g}"
    phases = fleet.parse_phases(args.phases)
    return fleet_requests(phases, args.seed), phases, f"phases {args.phases}"


def run(args: argparse.Namespace) -> dict:
    costs = StepCosts.load(args.costs)
    requests, phases, load = workload_of(args)
    results, extra = {}, {}
    for config in configs_of(args):
        out = simulate(config, requests, costs, args)
        results[config] = fleet.phase_figures(out["records"], out["names"], phases, args)
        extra[config] = {"switches": out["switches"], "decisions": out["decisions"][:200]}
    return {"results": results, "extra": extra, "phases": phases, "load": load, "costs": costs}


def report(args: argparse.Namespace, done: dict) -> None:
    phases, results = done["phases"], done["results"]
    title = (f"simulated: {args.servers} servers, costs {args.costs.name} ({done['costs'].model.split('/')[-1]}), "
             f"SLO TTFT {args.ttft_slo} s, TPOT {args.tpot_slo * 1000:g} ms; {done['load']}")
    table = fleet.format_table(results, phases)
    statics = {c: f["all"]["goodput"] for c, f in results.items() if c[0].isdigit()}
    lines = [title, "", table]
    if "planner" in results and statics:
        best = max(statics, key=statics.get)
        ratio = results["planner"]["all"]["goodput"] / statics[best] if statics[best] else float("inf")
        lines += ["", f"planner / best static ({best}): {ratio:.2f}x goodput"]
    print("\n" + "\n".join(lines))
    out = args.output_dir or Path(f"results/simulate-{datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulate.md").write_text("\n".join(lines) + "\n")
    (out / "simulate.json").write_text(json.dumps({"parameters": {k: str(v) for k, v in vars(args).items()},
                                                   "medians": results, "planner": done["extra"]}, indent=1))
    fleet.plot(results, phases, out / "simulate.png", title)


def validate(args: argparse.Namespace) -> list[dict]:
    """pd bench fleet's result against the simulation of the same servers, phases and
    configurations: TTFT and TPOT p50 (and p90) per configuration and phase."""
    measured = json.loads(Path(args.fleet).read_text())
    p = measured["parameters"]
    args.servers, args.phases, args.seed = int(p["servers"]), p["phases"], int(p["seed"])
    args.ttft_slo, args.tpot_slo, args.trace = float(p["ttft_slo"]), float(p["tpot_slo"]), None
    args.planner_args, args.configs = p.get("planner_args", args.planner_args), ",".join(measured["medians"])
    args.one_host = True  # pd bench fleet ran its servers on one machine
    simulated = run(args)["results"]
    rows = []
    for config, figures in measured["medians"].items():
        for phase, live in figures.items():
            if phase == "all":
                continue
            row = {"config": config, "phase": phase}
            for key in ("ttft_p50_s", "tpot_p50_s", "ttft_p90_s", "tpot_p90_s"):
                sim, real = simulated[config][phase][key], live[key]
                row[key] = (sim, real, None if sim is None or not real else (sim - real) / real)
            rows.append(row)
    return rows


def format_validation(rows: list[dict]) -> str:
    lines = ["| configuration | phase | TTFT p50 sim / live | error | TPOT p50 sim / live | error | "
             "TTFT p90 error | TPOT p90 error |", "|---|---|---|---:|---|---:|---:|---:|"]

    def pair(v: tuple, scale: float, unit: str) -> str:
        return f"{fleet._s(v[0], scale, unit)} / {fleet._s(v[1], scale, unit)}"

    def err(v: tuple) -> str:
        return "-" if v[2] is None else f"{v[2]:+.0%}"

    for r in rows:
        lines.append(f"| {r['config']} | {r['phase']} | {pair(r['ttft_p50_s'], 1, 's')} | {err(r['ttft_p50_s'])} | "
                     f"{pair(r['tpot_p50_s'], 1000, 'ms')} | {err(r['tpot_p50_s'])} | {err(r['ttft_p90_s'])} | "
                     f"{err(r['tpot_p90_s'])} |")
    return "\n".join(lines)


def add_run_flags(parser: argparse.ArgumentParser, validating: bool = False) -> None:
    add = parser.add_argument
    add("--costs", required=True, type=Path, help="the engine's fitted costs (pd bench simulate fit --output)")
    add("--request-timeout", type=float, default=300.0, help="seconds one request may take (default 300)")
    add("--switch-delay", type=float, default=0.0, metavar="S",
        help="seconds from a planner's switch to the proxy routing by it (default 0: an admin API call)")
    add("--output-dir", type=Path, default=None, help="where results go (default results/simulate-DATE)")
    add("--planner-args", default="--interval 1 --patience 2 --cooldown 5",
        help="pd planner's flags, as pd bench fleet passes them (default %(default)r)")
    add("--policy", choices=POLICIES, default=PROXY_DEFAULTS["policy"],
        help="how the proxy picks a prefill and a decode server, as pd proxy's --policy (default %(default)s; "
             "decode picks under conditional disaggregation are kv_aware, as pd proxy's)")
    if validating:
        add("--fleet", required=True, type=Path, help="a pd bench fleet result (its fleet.json) to compare with")
        return
    add("--servers", type=int, default=3, help="instances in the fleet, at least 2 (default 3)")
    add("--phases", default=fleet.DEFAULT_PHASES, help="the load as pd bench fleet's --phases (default its own)")
    add("--seed", type=int, default=0, help="of --phases' arrivals and lengths (default 0)")
    add("--trace", type=Path, default=None, help="a Mooncake-format JSONL trace to replay instead of --phases")
    add("--trace-phases", default=None, metavar="NAME:seconds=S;...",
        help="the trace's timeline cut into named phases for the figures (default: one phase)")
    add("--speed", type=float, default=1.0, help="the trace's arrivals this many times as fast (default 1)")
    add("--planner-start", default=None, metavar="KpMd",
        help="the split the planner starts from (default 1P(N-1)D, as pd bench fleet's)")
    add("--configs", default=None, help="comma-separated: planner, colocated, conditional, conditional-KpMd, KpMd "
                                        "(default: planner, colocated, conditional and every KpMd)")
    add("--ttft-slo", type=float, default=2.0, metavar="S", help="TTFT a request must get (default %(default)s)")
    add("--tpot-slo", type=float, default=0.1, metavar="S", help="TPOT a request must get (default %(default)s)")


def add_trace_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--costs", required=True, type=Path, help="the engine's fitted costs: the capacity the loads are shares of")
    add("--servers", type=int, required=True, help="instances the capacity is of")
    add("--phases", required=True, metavar="NAME:seconds=S,load=L,input=I,output=O;...",
        help="the trace's phases: load is a share of the fleet's capacity for the phase's mix (--capacity)")
    add("--capacity", choices=trace.CAPACITY_REFERENCES, default="static",
        help="what a phase's load is a share of: 'static' (default) the capacity, for the phase's mix, of the one "
             "split a fleet sized for the whole trace runs (the one keeping the most of each phase's best split); "
             "'phase' each phase's best split's, so that above 1 no split keeps the SLO")
    add("--ttft-slo", type=float, default=2.0, metavar="S",
        help="the TTFT (p90) the capacity keeps, queueing included (default %(default)s)")
    add("--tpot-slo", type=float, default=0.1, metavar="S", help="the TPOT the capacity keeps (default 0.1)")
    add("--burst", type=float, default=0.3, help="the rate swings +- this share around each phase's (default 0.3)")
    add("--burst-seconds", type=float, default=10.0, help="seconds of each swing (default 10)")
    add("--seed", type=int, default=0, help="of the arrivals and lengths (default 0)")
    add("--output", required=True, type=Path, help="the trace to write (JSONL, Mooncake's fields)")


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    fitting.add_fit_flags(sub.add_parser("fit", help="measure the engine's step costs in process and fit them"))
    add_run_flags(sub.add_parser("run", help="simulate the configurations on phases or a trace"))
    add_run_flags(sub.add_parser("validate", help="compare a pd bench fleet result with its simulation"), True)
    add_trace_flags(sub.add_parser("trace", help="write a bursty Mooncake-format trace loading a fleet by phase"))
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "pd bench simulate") -> dict | list:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        return ACTIONS[args.action](args)
    except ValueError as exc:
        parser.error(str(exc))


def _fit(args: argparse.Namespace) -> dict:
    costs, points = fitting.fit(args)
    out = Path(args.output)
    costs.save(out)
    out.with_suffix(".points.json").write_text(json.dumps(points, indent=1))
    print(fitting.format_points(points))
    print(f"\n{costs}\nwritten to {out}")
    return {"costs": costs, "points": points}


def _run(args: argparse.Namespace) -> dict:
    if args.servers < 2:
        raise ValueError("--servers must be at least 2")
    done = run(args)
    report(args, done)
    return done["results"]


def _validate(args: argparse.Namespace) -> list:
    rows = validate(args)
    table = format_validation(rows)
    print(f"\nsimulated ({args.costs}) against measured ({args.fleet}):\n{table}")
    out = args.output_dir or args.fleet.parent
    out.mkdir(parents=True, exist_ok=True)
    (out / "validate.md").write_text(f"simulated ({args.costs}) against measured ({args.fleet})\n\n{table}\n")
    return rows


def _trace(args: argparse.Namespace) -> dict:
    costs = StepCosts.load(args.costs)
    phases = trace.parse_trace_phases(args.phases)
    rates, split = trace.phase_capacities(phases, costs, args.servers, args.ttft_slo, args.tpot_slo, args.capacity)
    records = trace.generate(phases, rates, args.burst, args.burst_seconds, args.seed)
    trace.write_trace(records, args.output)
    cut = ";".join(f"{p.name}:seconds={p.seconds:g}" for p in phases)
    of = f"{split}P{args.servers - split}D's" if split else "each phase's best split's"
    print("capacity (" + of + "): " + ", ".join(f"{p.name} {r:.3g}/s" for p, r in zip(phases, rates)))
    print(f"{len(records)} requests written to {args.output}; replay with --trace {args.output} --trace-phases '{cut}'")
    return {"records": len(records), "trace_phases": cut, "capacities": rates, "split": split}


ACTIONS = {"fit": _fit, "run": _run, "validate": _validate, "trace": _trace}


if __name__ == "__main__":
    main()
