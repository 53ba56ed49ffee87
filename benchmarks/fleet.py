"""`pd bench fleet`: a load that changes phase by phase, served by the same servers split
every static way, as a colocated fleet, and managed by `pd planner`; goodput and SLO
attainment per phase.

The load: `--phases`, each `NAME:rate=R,input=I,output=O,seconds=S` (R requests per
second arriving as a Poisson process, random prompts of I tokens, O tokens generated,
for S seconds), one after the other without a pause; the same requests at the same times
for every configuration (`--seed`). The servers: `--servers` `pd serve --role both
--kv-connector nixl` that join a proxy with `--register`. The configurations:

- `KpMd`: K prefill and M decode servers, fixed (every split by default);
- `colocated`: every server prefills and decodes its own requests (the proxy's
  conditional disaggregation with no limit on what a decode server computes itself);
- `conditional`: 1P(N-1)D under the proxy's conditional disaggregation with its default
  limit (a decode server computes a prompt itself when it lacks at most
  `--local-prefill-max-tokens` of it, or when the prefill servers have more queued);
- `planner`: starting from 1P(N-1)D, `pd planner` with the SLOs switches roles as it sees fit
  (its decisions are saved beside the results).

A request meets the SLO when its TTFT <= `--ttft-slo` and its TPOT <= `--tpot-slo`;
goodput is such requests per second of the phase; attainment, their share of the phase's
requests. Every configuration runs `--repetitions` times, in ABBA order; medians are
reported (table, JSON, plot).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np

import launch
from benchmarks import serve
from benchmarks.datasets import LOW_TOKEN_ID, SampleRequest, random_dataset
from benchmarks.serve_metrics import RequestRecord
from launch import free_port, http_client, pd_command, stop_process

ADMIN_KEY = "pd-bench-fleet"
DEFAULT_PHASES = ("prefill:rate=2,input=1024,output=8,seconds=40;"
                  "decode:rate=1,input=64,output=128,seconds=40;"
                  "mixed:rate=1,input=512,output=48,seconds=40")
REGISTERED_WAIT_S = 120.0


@dataclass(frozen=True)
class Phase:
    name: str
    rate: float
    input: int
    output: int
    seconds: float


def split_phases(text: str, shape: str, keys: tuple[str, ...]) -> list[tuple[str, str, dict[str, float]]]:
    """`--phases`' `NAME:key=value,...;...`: each part, its name and its figures (every one
    of `keys` there); ValueError, naming `shape`, for a part that is not so, or for none."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, spec = part.partition(":")
        try:
            figures = {k.strip(): float(v) for k, v in (item.split("=") for item in spec.split(","))}
            missing = [k for k in keys if k not in figures]
            if missing:
                raise ValueError(f"no {', '.join(missing)}")
        except ValueError as exc:
            raise ValueError(f"--phases: {part!r} is not {shape} ({exc})") from None
        out.append((part, name.strip(), figures))
    if not out:
        raise ValueError("--phases names no phase")
    return out


def parse_phases(text: str) -> list[Phase]:
    phases = []
    for part, name, f in split_phases(text, "NAME:rate=R,input=I,output=O,seconds=S",
                                      ("rate", "input", "output", "seconds")):
        phase = Phase(name, f["rate"], int(f["input"]), int(f["output"]), f["seconds"])
        if phase.rate <= 0 or phase.input < 1 or phase.output < 1 or phase.seconds <= 0 or not phase.name:
            raise ValueError(f"--phases: {part!r} needs a name and positive figures")
        phases.append(phase)
    return phases


def workload(phases: list[Phase], seed: int, vocab_size: int) -> tuple[list[SampleRequest], list[float], list[str]]:
    """Every request of every phase: its sample, its send time (s from the start), its phase."""
    rng = np.random.default_rng(seed)
    samples, offsets, names, start = [], [], [], 0.0
    for k, phase in enumerate(phases):
        t = start + rng.exponential(1 / phase.rate)
        times = []
        while t < start + phase.seconds:
            times.append(t)
            t += rng.exponential(1 / phase.rate)
        samples += random_dataset(len(times), phase.input, phase.output, 0, vocab_size, seed + k)
        offsets += times
        names += [phase.name] * len(times)
        start += phase.seconds
    return samples, offsets, names


def configs_of(args: argparse.Namespace) -> list[str]:
    statics = [f"{k}p{args.servers - k}d" for k in range(1, args.servers)]
    asked = [c.strip() for c in args.configs.split(",") if c.strip()] if args.configs else \
        ["planner", "colocated", *statics]
    unknown = [c for c in asked if c not in ("planner", "colocated", "conditional", *statics)]
    if unknown:
        raise ValueError(f"unknown configuration(s) {', '.join(unknown)}: planner, colocated, conditional, "
                         f"{', '.join(statics)}")
    return asked


def initial_roles(config: str, n: int) -> list[str]:
    if config == "colocated":
        return ["decode"] * n
    prefill = 1 if config in ("planner", "conditional") else int(config.split("p")[0])
    return ["prefill"] * prefill + ["decode"] * (n - prefill)


@contextlib.contextmanager
def deployment(config: str, args: argparse.Namespace, logs: Path) -> Iterator[str]:
    """A proxy and `--servers` servers registered with it in `config`'s roles (and the
    planner, for `planner`); the proxy's URL."""
    with contextlib.ExitStack() as stack:
        def start(name: str, cmd: list[str], url: str, wait: bool = True, **kw) -> launch.Launched:
            launched = launch.start(cmd, url, logs / f"{config}-{name}.log", wait=wait, **kw)
            stack.callback(stop_process, launched.process)
            return launched

        port = free_port()
        conditional = {"colocated": ["--disagg-policy", "conditional", "--local-prefill-max-tokens", str(1 << 30)],
                       "conditional": ["--disagg-policy", "conditional"]}.get(config, [])
        proxy = start("proxy", pd_command("proxy", "--host", "127.0.0.1", "--port", str(port), "--admin-key",
                                          ADMIN_KEY, *conditional), f"http://127.0.0.1:{port}",
                      ready=lambda status: status in (200, 503))
        servers = []
        for i, role in enumerate(initial_roles(config, args.servers)):
            server_port = free_port()
            servers.append(start(f"server{i}", pd_command(
                "serve", "--model", str(args.model), "--host", "127.0.0.1", "--port", str(server_port), "--role",
                "both", "--kv-connector", "nixl", "--register", proxy.url, "--register-role", role,
                "--log-level", "warning", *shlex.split(args.server_args)), f"http://127.0.0.1:{server_port}",
                wait=False))
        launch.wait_started(*servers)
        wait_registered(proxy.url, args.servers, ADMIN_KEY)
        if config == "planner":
            start("planner", pd_command("planner", "--proxy", proxy.url, "--admin-key", ADMIN_KEY, "--ttft-slo",
                                        str(args.ttft_slo), "--tpot-slo", str(args.tpot_slo),
                                        *shlex.split(args.planner_args)), proxy.url, ready=lambda status: True)
        yield proxy.url


def wait_registered(proxy: str, n: int, admin_key: str) -> None:
    """Until `n` servers are in the proxy's fleet; RuntimeError past REGISTERED_WAIT_S."""
    deadline = time.monotonic() + REGISTERED_WAIT_S
    while time.monotonic() < deadline:
        listed = http_client().get(f"{proxy}/admin/instances", headers={"Authorization": f"Bearer {admin_key}"},
                                   timeout=5).json()["instances"]
        if len(listed) == n:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{n} servers did not all join the proxy in {REGISTERED_WAIT_S:g} s")


async def timed_run(proxy: str, args: argparse.Namespace, samples: list[SampleRequest],
                    offsets: list[float]) -> list[RequestRecord]:
    timeout = httpx.Timeout(args.request_timeout, connect=10)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = await serve.first_model(client, proxy)
        payloads = [serve.build_payload("/v1/completions", model, s, ignore_eos=True) for s in samples]
        warmup = [serve.build_payload("/v1/completions", model, s, ignore_eos=True) for s in samples[:args.servers * 2]]
        await serve.run_requests(client, f"{proxy}/v1/completions", warmup, samples[:len(warmup)],
                                 [0.0] * len(warmup), args.servers, label="warm-up")
        records, _ = await serve.run_requests(client, f"{proxy}/v1/completions", payloads, samples, offsets, None,
                                              label="fleet")
    return records


def phase_figures(records: list[RequestRecord], names: list[str], phases: list[Phase],
                  args: argparse.Namespace) -> dict[str, dict]:
    figures = {}
    for phase in phases:
        mine = [r for r, name in zip(records, names) if name == phase.name]
        ok = [r for r in mine if r.success]
        good = [r for r in ok if r.ttft <= args.ttft_slo and (r.tpot or 0.0) <= args.tpot_slo]
        ttfts, tpots = [r.ttft for r in ok], [r.tpot for r in ok if r.tpot is not None]
        figures[phase.name] = {
            "requests": len(mine), "failed": len(mine) - len(ok), "goodput": len(good) / phase.seconds,
            "attainment": len(good) / len(mine) if mine else None,
            "ttft_p50_s": _pct(ttfts, 50), "ttft_p90_s": _pct(ttfts, 90), "tpot_p50_s": _pct(tpots, 50),
            "tpot_p90_s": _pct(tpots, 90)}
    total = sum(p.seconds for p in phases)
    errors = sorted({r.error for r in records if r.error})
    figures["all"] = {"requests": len(records), "failed": sum(not r.success for r in records), "errors": errors[:3],
                      "goodput": sum(f["goodput"] * p.seconds for f, p in zip(figures.values(), phases)) / total}
    return figures


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def medians(runs: list[dict[str, dict]]) -> dict[str, dict]:
    out = {}
    for phase in runs[0]:
        out[phase] = {}
        for key in runs[0][phase]:
            values = [run[phase][key] for run in runs if run[phase][key] is not None]
            if key == "errors":
                out[phase][key] = sorted({e for v in values for e in v})[:3]
            else:
                out[phase][key] = statistics.median(values) if values else None
    return out


def format_table(results: dict[str, dict], phases: list[Phase]) -> str:
    lines = ["| configuration | " + " | ".join(f"{p.name}: goodput, SLO met, TTFT p90, TPOT p50" for p in phases)
             + " | all: goodput | failed |", "|---|" + "---|" * (len(phases) + 2)]
    for config, figures in results.items():
        cells = []
        for p in phases:
            f = figures[p.name]
            cells.append(f"{f['goodput']:.2f}/s, {_share(f['attainment'])}, {_s(f['ttft_p90_s'])}, "
                         f"{_s(f['tpot_p50_s'], 1000, 'ms')}")
        lines.append(f"| {config} | " + " | ".join(cells) + f" | {figures['all']['goodput']:.2f}/s | "
                     f"{figures['all']['failed']:g} |")
    return "\n".join(lines)


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _s(value: float | None, scale: float = 1.0, unit: str = "s") -> str:
    return "-" if value is None else f"{value * scale:.3g} {unit}"


def plot(results: dict[str, dict], phases: list[Phase], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2 + 2.5 * len(phases), 4))
    width = 0.8 / len(results)
    for k, (config, figures) in enumerate(results.items()):
        xs = [i + k * width for i in range(len(phases) + 1)]
        ax.bar(xs, [figures[p.name]["goodput"] for p in phases] + [figures["all"]["goodput"]], width, label=config)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(phases) + 1)], [p.name for p in phases] + ["all"])
    ax.set_ylabel("goodput (requests/s meeting the SLO)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", required=True, type=Path, help="model directory or .gguf file")
    add("--servers", type=int, default=3, help="servers in the fleet, at least 2 (default 3)")
    add("--phases", default=DEFAULT_PHASES, help=f"the load, phase by phase (default {DEFAULT_PHASES!r})")
    add("--configs", default=None, help="comma-separated: planner, colocated, conditional, KpMd (default: planner, "
                                        "colocated and every KpMd)")
    add("--ttft-slo", type=float, default=2.0, metavar="S", help="TTFT a request must get (default %(default)s)")
    add("--tpot-slo", type=float, default=0.1, metavar="S", help="TPOT a request must get (default %(default)s)")
    add("--repetitions", type=int, default=3, help="runs of each configuration, ABBA order (default 3)")
    add("--seed", type=int, default=0, help="of the arrivals and prompts (default 0)")
    add("--vocab-size", type=int, default=32000, help="random prompt ids below this (default %(default)s)")
    add("--server-args", default="--num-threads 1", help="more flags for every server (default %(default)r)")
    add("--planner-args", default="--interval 1 --patience 2 --cooldown 5",
        help="more flags for pd planner (default %(default)r)")
    add("--request-timeout", type=float, default=300.0, help="seconds one request may take (default 300)")
    add("--output-dir", type=Path, default=None, help="where results go (default results/fleet-DATE)")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "pd bench fleet") -> dict:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        phases, configs = parse_phases(args.phases), configs_of(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.servers < 2 or args.repetitions < 1 or args.vocab_size <= LOW_TOKEN_ID:
        parser.error("--servers must be at least 2, --repetitions at least 1")
    launch.deployment_secret()
    samples, offsets, names = workload(phases, args.seed, args.vocab_size)
    out = args.output_dir or Path(f"results/fleet-{datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repetitions):
            for config in configs if rep % 2 == 0 else reversed(configs):
                logs = Path(tmp) / f"rep{rep}"
                with deployment(config, args, logs) as proxy:
                    records = asyncio.run(timed_run(proxy, args, samples, offsets))
                runs[config].append(phase_figures(records, names, phases, args))
                if config == "planner":
                    (out / f"planner-rep{rep}.log").write_text((logs / "planner-planner.log").read_text())
    results = {config: medians(r) for config, r in runs.items()}
    title = (f"{args.model.name}: {args.servers} servers ({args.server_args}), SLO TTFT {args.ttft_slo} s, "
             f"TPOT {args.tpot_slo * 1000:g} ms; {args.repetitions} runs, medians")
    table = format_table(results, phases)
    print(f"\n{title}\n{table}")
    (out / "fleet.md").write_text(f"{title}\n\nphases: {args.phases}\n\n{table}\n")
    (out / "fleet.json").write_text(json.dumps({"parameters": {k: str(v) for k, v in vars(args).items()},
                                                "medians": results, "runs": runs}, indent=1))
    plot(results, phases, out / "fleet.png", title)
    return results
