"""`kiln` command line: serve | chat | eval | bench | adapters | train | datasets | judgments | requests | corrections."""

from __future__ import annotations

import argparse
import importlib
import sys

from kiln import __version__

# Each module exposes `register(subparsers)`, adding its sub-command(s) with `set_defaults(func=...)`;
# `func(args) -> int` is the exit status.
COMMAND_MODULES = [
    "kiln.commands.serve",
    "kiln.commands.chat",
    "kiln.commands.datasets",
    "kiln.commands.judgments",
    "kiln.commands.adapters",
    "kiln.commands.bench",
    "kiln.commands.eval",
    "kiln.commands.train",
    "kiln.commands.requests",
    "kiln.commands.corrections",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln",
        description="Serve a language model over the OpenAI API and make it better while it serves.",
    )
    parser.add_argument("--version", action="version", version=f"kiln {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
