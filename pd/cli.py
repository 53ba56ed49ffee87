"""The `pd` command line: one subcommand per entry in COMMANDS."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata


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


# Later subcommands (serve, generate, make-model, bench) register here.
COMMANDS: dict[str, Command] = {
    "version": Command("print the pd-serve version", lambda parser: None, _run_version),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per registered command."""
    parser = argparse.ArgumentParser(prog="pd", description="Disaggregated prefill/decode LLM serving.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", help="subcommand to run")
    for name, command in COMMANDS.items():
        sub = subparsers.add_parser(name, help=command.help, description=command.help)
        command.add_flags(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse argv (default: sys.argv[1:]) and run the chosen command; 2 if none was given."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.run(args)
