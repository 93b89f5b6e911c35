"""The ``hisparse`` command line: one subcommand per tool."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import __version__, calc, scenario, simulate
from .engine import demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hisparse", description=__doc__)
    parser.add_argument("--version", action="version", version=f"hisparse {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo.add_parser(sub)
    scenario.add_parser(sub)
    calc.add_parser(sub)
    simulate.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return 2
    return int(args.func(args) or 0)
