"""`pd bench compare`: the same workload against several deployments of one model on
this machine, each launched and torn down here, with a warm-up and repetitions; a
markdown table of medians, a JSON file with every run, and a PNG plot.

Configurations (`--configs`, comma-separated): see `deployments.py` (colocated, pd and
its variants, 2P2D behind each routing policy, and 1P1D with all the prefill cache).

Every configuration sees the same prompts: repetition r uses seed `--seed + r` for all of
them (fresh prompts per repetition, so one repetition does not warm the next one's
prefix cache); the warm-up uses other prompts. The configurations run side by side,
their repetitions interleaved (`run_configs`). Prefix-cache and KV-transfer figures are
read from every server's /metrics before and after each run, and summed: "P hit rate"
over the servers that prefill, "prefix hit rate" and "KV read" over those that decode
(a colocated server is both); "prefilled on D" is the share of requests the proxy let a
decode server prefill itself (`--disagg-policy conditional`), "P read from D" the share
whose prefill server read a prefix from the decode server first.

    pd bench compare --model DIR --dataset prefix-repetition --num-prompts 64

`--peer NAME=URL` adds a server this command does not start (vLLM, llama.cpp's
llama-server, any OpenAI-compatible one serving the same model): it is measured by the same
client, its repetitions interleaved with ours, so that the two are compared in one run on
one machine (only ratios measured so carry over between machines). Its server-side columns
(hit rates, KV read) stay empty: they are read from our servers' /metrics.
`--peer-start NAME=COMMAND` has this command start that peer's server (COMMAND, a shell
command line, must serve NAME's URL) for each of its runs and stop it after; then every
configuration runs alone (`run_alone`): no idle server's threads compete with the one
measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import statistics
import tempfile
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path

from benchmarks import serve
from benchmarks.datasets import add_dataset_args
from benchmarks.deployments import CONFIGS, Deployment, combined_deltas, deploy, path_share, scrape
from launch import process
from launch.signals import install_signal_handlers

WARMUP_SEED_OFFSET = 10_000
FIGURES = {  # column -> (title, how to read it from one run's result)
    "output_throughput": ("output tok/s", lambda r: r["metrics"]["output_throughput"]),
    "mean_ttft_ms": ("mean TTFT (ms)", lambda r: r["metrics"]["mean_ttft_ms"]),
    "mean_ttft_later_ms": ("TTFT turns >= 2 (ms)", lambda r: r["metrics"].get("mean_ttft_later_turns_ms")),
    "p99_ttft_ms": ("p99 TTFT (ms)", lambda r: r["metrics"]["p99_ttft_ms"]),
    "mean_tpot_ms": ("mean TPOT (ms)", lambda r: r["metrics"]["mean_tpot_ms"]),
    "p99_itl_ms": ("p99 ITL (ms)", lambda r: r["metrics"]["p99_itl_ms"]),
    "p_hit_rate": ("P hit rate", lambda r: r["servers"]["prefill"]["hit_rate"]),
    "prefix_hit_rate": ("prefix hit rate", lambda r: r["servers"]["decode"]["hit_rate"]),
    "tier_hit_rate": ("of it from disk", lambda r: r["servers"]["decode"].get("tier_hit_rate")),
    "kv_mib": ("KV read (MiB)", lambda r: _mib(r["servers"]["decode"]["kv_transfer_bytes"])),
    "on_d": ("prefilled on D", lambda r: r["servers"]["local_share"]),
    "reuse": ("P read from D", lambda r: r["servers"].get("reuse_share")),
}
RATES = ("p_hit_rate", "prefix_hit_rate", "tier_hit_rate", "on_d", "reuse")
# columns left out when no row has them (not multi-turn, no proxy, no offload tier)
ONLY_WHERE_MEASURED = ("mean_ttft_later_ms", "reuse", "tier_hit_rate")


def _mib(num_bytes: float | None) -> float | None:
    return None if num_bytes is None else num_bytes / 2**20


def serve_args(args: argparse.Namespace, deployment: Deployment, seed: int, num_prompts: int,
               label: str) -> argparse.Namespace:
    """`bench serve`'s arguments for one run: the dataset flags as given to compare."""
    argv = ["--base-url", deployment.base_url, "--metrics-url", deployment.metrics_url,
            "--endpoint", args.endpoint, "--num-prompts", str(num_prompts), "--seed", str(seed),
            "--request-rate", str(args.request_rate), "--burstiness", str(args.burstiness), "--label", label]
    if args.max_concurrency:
        argv += ["--max-concurrency", str(args.max_concurrency)]
    if args.ignore_eos:
        argv.append("--ignore-eos")
    for action in _dataset_actions():
        value = getattr(args, action.dest)
        if action.nargs == 0:  # a switch
            argv += [action.option_strings[0]] if value else []
        elif value is not None:
            argv += [action.option_strings[0], str(value)]
    return serve.build_parser().parse_args(argv)


def _dataset_actions() -> list[argparse.Action]:
    parser = argparse.ArgumentParser()
    add_dataset_args(parser)
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


PEER_STARTUP_TIMEOUT_S = 900.0  # a peer's start (vLLM compiles its kernels on CPU for minutes)


def run_alone(configs: list[str], args: argparse.Namespace, workdir: Path) -> list[dict]:
    """One row per configuration, each repetition run with only its own servers up:
    deployed (a peer with a start command started), warmed up, measured and stopped; the
    configurations in turn, in reverse order on odd repetitions (ABBA)."""
    runs: dict[str, list[dict]] = {config: [] for config in configs}
    for rep in range(args.repetitions):
        for config in configs if rep % 2 == 0 else configs[::-1]:
            print(f"== {config}, repetition {rep + 1}", flush=True)
            with up(config, args, workdir) as deployment:
                warm_up(config, deployment, args)
                runs[config].append(run_once(config, deployment, args, rep))
    return [{"config": config, "medians": medians(runs[config]), "runs": runs[config]} for config in configs]


@contextlib.contextmanager
def up(config: str, args: argparse.Namespace, workdir: Path) -> Iterator[Deployment]:
    """The configuration's servers, up for the block: ours deployed, a peer started by its
    command (`--peer-start`) or, without one, as it runs."""
    peer = args.peers.get(config)
    if peer is None:
        with deploy(config, args, workdir) as deployment:
            yield deployment
        return
    command = args.peer_starts.get(config)
    if command is None:
        yield Deployment(peer, f"{peer}/metrics")
        return
    log = workdir / f"{config.replace(':', '-')}.log"
    with process.running(shlex.split(command), peer, log, timeout_s=PEER_STARTUP_TIMEOUT_S):
        yield Deployment(peer, f"{peer}/metrics")


def run_configs(configs: list[str], args: argparse.Namespace, workdir: Path) -> list[dict]:
    """One row per configuration. Interleaved (the default), every configuration is
    deployed at once and warmed up, then repetition r runs them in turn, in reverse order
    on odd r (ABBA): a machine that drifts (other load, clocks, caches) shifts every
    configuration alike instead of whichever ran last. Idle servers cost ~1 % of a core
    each; memory is every deployment's together. Otherwise each is deployed, run and
    stopped in turn."""
    runs: dict[str, list[dict]] = {config: [] for config in configs}
    for group in [configs] if args.interleave else [[config] for config in configs]:
        with contextlib.ExitStack() as stack:
            deployments = {}
            for config in group:
                print(f"== {config}", flush=True)
                peer = args.peers.get(config)
                deployments[config] = Deployment(peer, f"{peer}/metrics") if peer else \
                    stack.enter_context(deploy(config, args, workdir))
                warm_up(config, deployments[config], args)
            for rep in range(args.repetitions):
                for config in group if rep % 2 == 0 else group[::-1]:
                    runs[config].append(run_once(config, deployments[config], args, rep))
    return [{"config": config, "medians": medians(runs[config]), "runs": runs[config]} for config in configs]


def warm_up(config: str, deployment: Deployment, args: argparse.Namespace) -> None:
    """`--warmup-prompts` requests of other prompts than the runs', not counted."""
    if args.warmup_prompts:
        asyncio.run(serve.benchmark(serve_args(args, deployment, args.seed + WARMUP_SEED_OFFSET,
                                               args.warmup_prompts, f"{config}-warmup")))


def run_once(config: str, deployment: Deployment, args: argparse.Namespace, rep: int) -> dict:
    before = _snapshot(deployment)
    result = asyncio.run(serve.benchmark(serve_args(args, deployment, args.seed + rep, args.num_prompts,
                                                    f"{config}-{rep}")))
    after = _snapshot(deployment)
    result["servers"] = {"prefill": combined_deltas(before[0], after[0]),
                         "decode": combined_deltas(before[1], after[1]),
                         "local_share": path_share(before[2], after[2], "local"),
                         "reuse_share": path_share(before[2], after[2], "disaggregated+reuse")}
    print(f"  {config} repetition {rep + 1}/{args.repetitions}: "
          f"{result['metrics']['output_throughput']:.1f} output tok/s, {result['metrics']['failed']} failed",
          flush=True)
    return result


def _snapshot(deployment: Deployment) -> tuple:
    """The prefill servers', the decode servers' and the proxy's (None without one) /metrics."""
    proxy = scrape([deployment.proxy_url])[0] if deployment.proxy_url else None
    return scrape(deployment.prefill_urls), scrape(deployment.decode_urls), proxy


def medians(runs: list[dict]) -> dict:
    figures = {}
    for key, (_, read) in FIGURES.items():
        values = [v for v in (read(r) for r in runs) if v is not None]
        figures[key] = statistics.median(values) if values else None
    figures["failed"] = sum(r["metrics"]["failed"] for r in runs)
    return figures


def format_table(rows: list[dict]) -> str:
    keys = [key for key in FIGURES
            if key not in ONLY_WHERE_MEASURED or any(row["medians"].get(key) is not None for row in rows)]
    titles = [FIGURES[key][0] for key in keys]
    lines = ["| configuration | " + " | ".join(titles) + " | failed |", "|---|" + "---|" * (len(titles) + 1)]
    for row in rows:
        cells = []
        for key in keys:
            value = row["medians"].get(key)
            cells.append("-" if value is None else (f"{value:.1%}" if key in RATES else f"{value:.1f}"))
        lines.append(f"| {row['config']} | " + " | ".join(cells) + f" | {row['medians']['failed']} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key in zip(axes, ("output_throughput", "mean_ttft_ms", "mean_tpot_ms")):
        values = [r["medians"][key] or 0 for r in rows]
        ax.bar(names, values, color="#4c72b0")
        ax.set_title(FIGURES[key][0] + " (median)")
        ax.tick_params(axis="x", labelrotation=30)
        for i, v in enumerate(values):
            ax.annotate(f"{v:.1f}", (i, v), ha="center", va="bottom", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser(prog: str = "pd bench compare") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", required=True, type=Path, help="model directory or .gguf file every configuration serves")
    add("--configs", default=",".join(CONFIGS[:2]),
        help=f"comma-separated configurations among {', '.join(CONFIGS)} (default: colocated,pd)")
    add("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
        help="the servers' --dtype; auto, pd serve's default, is the checkpoint's own (a quantized .gguf: bfloat16 "
             "where the CPU computes it, and then its blocks with --quantization auto) (default auto)")
    add("--endpoint", choices=serve.ENDPOINTS, default="/v1/completions", help="API route (default /v1/completions)")
    add("--num-prompts", type=int, default=64, help="requests per repetition (default 64)")
    add("--warmup-prompts", type=int, default=8, help="requests sent first and not counted (default 8)")
    add("--repetitions", type=int, default=3, help="timed runs per configuration; medians reported (default 3)")
    add("--interleave", action=argparse.BooleanOptionalAction, default=True,
        help="deploy every configuration at once and alternate their repetitions (ABBA), so that the machine's "
             "drift falls on all alike; --no-interleave runs one deployment at a time, for configurations that "
             "do not fit in memory together (default on)")
    add("--request-rate", type=float, default=float("inf"), help="mean arrivals per second (default inf)")
    add("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (default 1: Poisson)")
    add("--max-concurrency", type=int, default=8, help="most requests in flight (default 8)")
    add("--seed", type=int, default=0, help="seed of repetition 0's prompts; repetition r uses seed+r (default 0)")
    add("--ignore-eos", action="store_true", help="run every request to its output length")
    add("--prefill-kv-cache-memory", type=int, default=None, metavar="BYTES",
        help="KV cache of each prefill server in the PD configurations (1p1d-all-cache: twice this, the two "
             "2P2D prefill servers' together) (default: the servers' --kv-cache-memory default)")
    add("--server-args", default="", help="more `pd serve` flags for every server, one quoted string "
        "(e.g. \"--max-num-batched-tokens 1024\")")
    add("--proxy-args", default="", help="more `pd proxy` flags for the PD configurations, one quoted string "
        "(e.g. \"--kv-overlap-weight 2\")")
    add("--peer", action="append", default=[], metavar="NAME=URL",
        help="also measure a running OpenAI-compatible server (e.g. vllm=http://127.0.0.1:8000), not started or "
             "stopped here, as a row named peer:NAME, interleaved with the configurations; repeatable")
    add("--peer-start", action="append", default=[], metavar="NAME=COMMAND",
        help="start peer NAME's server with this command (one quoted string, serving the --peer URL of NAME; its "
             "/health is awaited) before each of its runs and stop it after; then every configuration runs alone, "
             "deployed and stopped per repetition, so that only the server measured is up (repeatable)")
    add("--output-dir", type=Path, default=None,
        help="where compare.md, compare.json and compare.png go (default results/compare-DATE)")
    add_dataset_args(parser)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "pd bench compare") -> list[dict]:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        parser.error(f"unknown configuration(s) {', '.join(unknown) or '(none given)'}; "
                     f"choose among {', '.join(CONFIGS)}")
    args.peers = {}
    for peer in args.peer:
        name, sep, url = peer.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            parser.error(f"--peer takes NAME=URL with an http(s) URL, got {peer!r}")
        args.peers[f"peer:{name}"] = url.rstrip("/")
    configs += list(args.peers)
    args.peer_starts = {}
    for start in args.peer_start:
        name, sep, command = start.partition("=")
        if not sep or f"peer:{name}" not in args.peers or not command.strip():
            parser.error(f"--peer-start takes NAME=COMMAND for a NAME given with --peer, got {start!r}")
        args.peer_starts[f"peer:{name}"] = command
    if args.repetitions < 1 or args.num_prompts < 1 or args.warmup_prompts < 0:
        parser.error("--repetitions and --num-prompts must be at least 1, --warmup-prompts at least 0")
    if not ((args.model / "config.json").is_file() or args.model.suffix == ".gguf" and args.model.is_file()):
        parser.error(f"{args.model} is neither a model directory (no config.json) nor a .gguf file")
    out = args.output_dir or Path(f"results/compare-{datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = (run_alone if args.peer_starts else run_configs)(configs, args, Path(tmp))
    title = (f"{args.model.name} {args.dtype}, {args.dataset}, {args.num_prompts} prompts x {args.repetitions}, "
             f"concurrency {args.max_concurrency}, {os.cpu_count()} CPUs"
             + (f", servers with {args.server_args}" if args.server_args else "")
             + (f", proxy with {args.proxy_args}" if args.proxy_args else "")
             + "".join(f", {name} started as `{command}`" for name, command in args.peer_starts.items()))
    table = format_table(rows)
    print(f"\n{title} (medians)\n{table}")
    (out / "compare.md").write_text(f"{title} (medians)\n\n{table}\n")
    parameters = {k: str(v) for k, v in vars(args).items()}
    (out / "compare.json").write_text(json.dumps({"parameters": parameters, "rows": rows}, indent=2) + "\n")
    plot(rows, out / "compare.png", title)
    print(f"wrote {out}/compare.md, compare.json, compare.png")
    return rows


if __name__ == "__main__":
    install_signal_handlers()  # SIGTERM unwinds through the deployments' teardown
    main()
