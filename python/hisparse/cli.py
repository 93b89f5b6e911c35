"""The ``hisparse`` command line: one subcommand per tool, each imported only when it is chosen, so that
``hisparse calc`` (pure Python) loads neither torch nor the compiled core.

Bad usage ends in one line on stderr and exit status 2, whether argparse finds it in a flag or the tool finds it
in the configuration (a :class:`hisparse.HiSparseError` raised by what the run was asked to do). An
:class:`hisparse.InvariantError` is a bug in hisparse: one line too, exit status 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from .errors import HiSparseError, InvariantError

#: name -> (module with ``add_parser(subparsers)``, one-line help). The help lives here so that ``hisparse
#: --help`` lists every tool without importing any of them.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("hisparse.engine.demo", "the reference engine in every mode, checked against unlimited memory"),
    "scenario": ("hisparse.scenario", "a small serving run on the CPU path, checked byte for byte"),
    "calc": ("hisparse.tools.calc", "plan concurrency with and without HiSparse (pure Python)"),
    "simulate": ("hisparse.tools.simulate", "a serving simulation of one node through the real residency core"),
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage text stays behind ``--help``)."""

    commands: dict[str, argparse.ArgumentParser]  # the top-level parser's, by name

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


class _Version(argparse.Action):
    """``--version``, reading the version from the compiled core only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print the version and exit")

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from ._core import __version__

        parser.exit(0, f"hisparse {__version__}\n")


def build_parser(command: str | None = None) -> ArgumentParser:
    """The parser with ``command``'s full set of flags; every other command is listed by name and help only."""
    parser = ArgumentParser(prog="hisparse", description="Tools of hisparse, the KV residency core for sparse-"
                            "attention models. `hisparse COMMAND --help` lists a command's flags.")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        if name == command:
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    parser.commands = sub.choices
    return parser


def _fail(prog: str, message: object, status: int) -> int:
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``hisparse ARGV``; returns the exit status (argparse raises ``SystemExit(2)`` for bad flags)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # The first word names the tool, unless a help flag comes first: then only the list of tools is printed.
    first = next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))
    command = argv[first] if first < len(argv) and not {"-h", "--help"} & set(argv[:first]) else None
    try:
        parser = build_parser(command if command in COMMANDS else None)
    except ImportError as exc:  # a tool's dependency (torch, the compiled core) is missing
        return _fail(f"hisparse {command}", f"cannot load this tool: {exc}", 1)
    except KeyboardInterrupt:  # while the tool's imports (torch: seconds) load
        return _fail(f"hisparse {command}" if command in COMMANDS else "hisparse", "interrupted", 130)
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.error(f"choose a command: {', '.join(COMMANDS)}")
    if extra:  # reported by the command's parser, so that the message names the command
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    prog = f"hisparse {args.command}"
    try:
        return int(args.func(args) or 0)
    except InvariantError as exc:
        return _fail(prog, f"internal error, a bug in hisparse (please report it): {exc}", 1)
    except HiSparseError as exc:  # the configuration cannot work: the message says what to change
        return _fail(prog, exc, 2)
    except MemoryError:
        return _fail(prog, "out of memory: ask for a smaller run", 1)
    except KeyboardInterrupt:
        return _fail(prog, "interrupted", 130)
    except BrokenPipeError:  # `hisparse calc | head -1`: the reader left; say nothing more on a closed pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
