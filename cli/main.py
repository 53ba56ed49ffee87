"""The `pd` command line: one subcommand per entry in COMMANDS."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path


@dataclass(frozen=True)
class Command:
    """A subcommand: its help line, how it adds its flags, and what it runs."""

    help: str
    add_flags: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def package_version() -> str:
    """The installed version of pd-serve, or the source version if not installed."""
    try:
        return metadata.version("pd-serve")
    except metadata.PackageNotFoundError:
        return "0.1.0"


def _run_version(args: argparse.Namespace) -> int:
    print(package_version())
    return 0


# Spelled out rather than imported from pd.models.make_model, so that building the parser
# does not import torch; a test checks the two lists agree.
MAKE_MODEL_ARCHS = ("qwen3", "gemma3", "bamba", "granitehybrid")


def _add_make_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", required=True, choices=MAKE_MODEL_ARCHS,
                        help="model family whose published checkpoint format to reproduce")
    parser.add_argument("--out", required=True, help="directory to write the checkpoint into")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed for the random weights; same seed, identical files (default 0)")


def _run_make_model(args: argparse.Namespace) -> int:
    from pd.models.make_model import make_model  # torch is heavy: import only when run

    print(make_model(args.arch, args.out, args.seed))
    return 0


def _add_generate_flags(parser: argparse.ArgumentParser) -> None:
    from pd.config import add_engine_flags

    add_engine_flags(parser)
    parser.add_argument("--prompt", action="append", required=True,
                        help="prompt text; repeat the flag for several prompts (batched together)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens to generate per prompt (default 16)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default 0)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="sample among the k most likely tokens (default: no limit)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample among the most likely tokens reaching this mass (default 1.0)")
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed (default: none)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")


def _run_generate(args: argparse.Namespace) -> int:
    import json

    from pd.config import config_from_args
    from pd.contracts.sampling_params import SamplingParams
    from pd.llm import LLM

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
        config = config_from_args(args).resolve()
        llm = LLM.from_config(config)
    except (ValueError, OSError) as exc:  # bad flags, or a model that cannot be read: one line, exit 1
        raise SystemExit(f"pd generate: {exc}") from None
    print(f"pd generate: dtype {config.model.dtype} ({config.model.dtype_reason})", file=sys.stderr)
    for prompt, out in zip(args.prompt, llm.generate(args.prompt, params)):
        print(json.dumps({"prompt": prompt, "token_ids": out.token_ids, "text": out.text,
                          "finish_reason": out.finish_reason}))
    return 0


def _add_serve_flags(parser: argparse.ArgumentParser) -> None:
    from pd.server.main import add_serve_flags

    add_serve_flags(parser)


def _run_serve(args: argparse.Namespace) -> int:
    from pd.server.main import run_serve

    return run_serve(args)


def _add_proxy_flags(parser: argparse.ArgumentParser) -> None:
    from proxy.main import add_proxy_flags

    add_proxy_flags(parser)


def _run_proxy(args: argparse.Namespace) -> int:
    from proxy.main import run_proxy

    return run_proxy(args)


def _add_planner_flags(parser: argparse.ArgumentParser) -> None:
    from planner.main import add_planner_flags

    add_planner_flags(parser)


def _run_planner(args: argparse.Namespace) -> int:
    from planner.main import run_planner

    return run_planner(args)


def _add_bench_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bench_command", choices=["serve", "compare", "step", "fleet", "simulate"],
                        help="serve: load-test an OpenAI-compatible server; compare: launch several "
                             "deployments of one model and run the same load on each; step: time one "
                             "engine's decode step part by part, in process; fleet: a load changing phase by "
                             "phase on every static split of a fleet, colocated, and under pd planner; "
                             "simulate: a discrete-event model of a fleet with costs fitted from the engine "
                             "(fit, run, validate, trace) (see --help of each)")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's own flags")


def _run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "compare":
        from benchmarks import compare
        from launch.signals import install_signal_handlers

        install_signal_handlers()  # SIGTERM unwinds through the deployments' teardown
        rows = compare.main(args.bench_args, prog="pd bench compare")
        return 0 if all(r["medians"]["failed"] == 0 for r in rows) else 1
    if args.bench_command == "fleet":
        from benchmarks import fleet
        from launch.signals import install_signal_handlers

        install_signal_handlers()  # SIGTERM unwinds through the deployments' teardown
        results = fleet.main(args.bench_args, prog="pd bench fleet")
        return 0 if all(r["all"]["failed"] == 0 for r in results.values()) else 1
    if args.bench_command == "simulate":
        from benchmarks import simulate

        simulate.main(args.bench_args, prog="pd bench simulate")
        return 0
    if args.bench_command == "step":
        from benchmarks import step

        step.main(args.bench_args, prog="pd bench step")
        return 0
    from benchmarks import serve

    result = serve.main(args.bench_args, prog="pd bench serve")
    return 0 if result["metrics"]["completed"] else 1


def _add_convert_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("gguf", type=Path, help="the .gguf file to convert")
    parser.add_argument("output", type=Path, help="the HF folder to write (config.json, model.safetensors, "
                                                  "tokenizer files); created if missing")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="dtype of the dequantized weights written (default float32: exact)")


def _run_convert(args: argparse.Namespace) -> int:
    import torch

    from pd.models.gguf import GGUFModel

    try:
        out = GGUFModel(args.gguf).write_hf_folder(args.output, getattr(torch, args.dtype))
    except (ValueError, OSError) as exc:
        raise SystemExit(f"pd convert: {exc}") from None
    print(f"pd convert: wrote {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")
    return 0


def _add_tp_rank_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--join", required=True, metavar="HOST:PORT",
                        help="the server's --tp-host:--tp-port; tried until the rank joins, the server refuses it "
                             "(wrong secret, a rank it does not await), or --join-timeout passes")
    parser.add_argument("--rank", type=int, required=True,
                        help="this rank: one of the server's ranks past its --tp-local-ranks (K..N-1), each joined "
                             "once")
    parser.add_argument("--device", default=None,
                        help="this rank's torch device, e.g. cuda:1 (default: the server's device type, first "
                             "device: cuda or cpu)")
    parser.add_argument("--join-timeout", type=float, default=300.0,
                        help="seconds to keep trying to join the server (a connection it drops or that fails is "
                             "tried again until then) (default %(default)s)")


def _run_tp_rank(args: argparse.Namespace) -> int:
    from pd.worker.tp_ranks import run_remote_rank

    return run_remote_rank(args.join, args.rank, args.device, args.join_timeout)


COMMANDS: dict[str, Command] = {
    "version": Command("print the pd-serve version", lambda parser: None, _run_version),
    "make-model": Command("write a tiny random checkpoint in a family's published HF format",
                          _add_make_model_flags, _run_make_model),
    "generate": Command("generate from prompts offline and print one JSON object per prompt",
                        _add_generate_flags, _run_generate),
    "convert": Command("write a .gguf model out as an HF folder (dequantized weights, config, tokenizer)",
                       _add_convert_flags, _run_convert),
    "serve": Command("serve a model over an OpenAI-compatible HTTP API (engine core in its own process)",
                     _add_serve_flags, _run_serve),
    "tp-rank": Command("run one tensor-parallel rank of a server on another node: it joins the server's "
                       "--tp-host:--tp-port (the deployment's secret in PD_KV_TRANSFER_SECRET), loads its shard "
                       "of the same model path and runs every step the server sends until the server stops",
                       _add_tp_rank_flags, _run_tp_rank),
    "proxy": Command("front prefill and decode servers: P prefills and keeps the KV, then D decodes with P's "
                     "kv_transfer_params",
                     _add_proxy_flags, _run_proxy),
    "planner": Command("size a proxy's prefill and decode pools by SLO: watch its fleet and the servers' "
                       "figures, predict TTFT and TPOT of each split (queueing included), switch roles of "
                       "--role both servers toward the best",
                       _add_planner_flags, _run_planner),
    "bench": Command("benchmarks: `pd bench serve` load-tests a server (TTFT, TPOT, ITL, throughput); "
                     "`pd bench compare` runs it against several deployments",
                     _add_bench_flags, _run_bench),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser with one subparser per registered command; `only`: that
    command's flags alone (the others listed without theirs), so that `pd serve` does
    not import the proxy's and the benchmarks' modules for their flags (0.2 s of every
    server start)."""
    parser = argparse.ArgumentParser(prog="pd", description="Disaggregated prefill/decode LLM serving.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", help="subcommand to run")
    for name, command in COMMANDS.items():
        sub = subparsers.add_parser(name, help=command.help, description=command.help)
        if only in (None, name):
            command.add_flags(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse argv (default: sys.argv[1:]) and run the chosen command; 2 if none was given."""
    argv = sys.argv[1:] if argv is None else argv
    named = next((arg for arg in argv if not arg.startswith("-")), None)  # the command, if any
    parser = build_parser(named if named in COMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
