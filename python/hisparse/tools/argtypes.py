"""Argument types for the command-line tools: bounded numbers, lists of them, names and output paths.

Each type turns bad text into ``argparse.ArgumentTypeError`` with a message that names the allowed range, so
argparse reports it on one line and exits 2. Integers may carry thousands separators (``81,920`` or
``81_920``), as people copy them from tables. Counts stop at ``U32_MAX``: the core keeps tokens, blocks, rows
and pages in 32 bits, and beyond that a number is a typo, not a deployment.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
from collections.abc import Callable, Sequence

U32_MAX = 2**32 - 1
SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes any u64
#: The largest memory size a GiB flag takes, 1 EiB: far beyond any machine, and float arithmetic on bytes stays
#: finite and exact to well under a byte per block.
MAX_GIB = float(2**30)
PLOT_FORMATS = ("png", "pdf", "svg")


def _show(text: object) -> str:
    """The value as an error message quotes it: a pasted screenful stays one short line."""
    text = str(text)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} characters)"


def _int(text: str) -> int:
    try:
        return int(text.replace(",", "").replace("_", ""))
    except ValueError:  # also a string of more than 4,300 digits
        raise argparse.ArgumentTypeError(f"not an integer: {_show(repr(text))}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {_show(repr(text))}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {_show(text)}")
    return value


def int_range(lo: int, hi: int) -> Callable[[str], int]:
    """An integer in ``[lo, hi]``."""

    def parse(text: str) -> int:
        value = _int(text)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must lie in [{lo:,}, {hi:,}], got {_show(f'{value:,}')}")
        return value

    parse.__name__ = f"integer in [{lo}, {hi}]"
    return parse


def float_range(lo: float, hi: float, *, lo_open: bool = False) -> Callable[[str], float]:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""

    def parse(text: str) -> float:
        value = _float(text)
        if value < lo or (lo_open and value == lo) or value > hi:
            left = "(" if lo_open else "["
            raise argparse.ArgumentTypeError(f"must lie in {left}{lo:g}, {hi:g}], got {_show(text)}")
        return value

    parse.__name__ = f"number in [{lo}, {hi}]"
    return parse


positive_int = int_range(1, U32_MAX)
nonnegative_int = int_range(0, U32_MAX)
seed = int_range(0, SEED_MAX)
gib = float_range(0.0, MAX_GIB)
positive_gib = float_range(0.0, MAX_GIB, lo_open=True)


def positive_float(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {_show(text)}")
    return value


def nonnegative_float(text: str) -> float:
    """A finite number, at least 0."""
    value = _float(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number, at least 0, got {_show(text)}")
    return value


def positive_int_list(text: str) -> list[int]:
    """``1,8,16``: a comma-separated list of integers in ``[1, U32_MAX]``, repeats dropped."""
    parts = [p for p in text.replace(" ", "").split(",") if p]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of positive integers, got "
                                         f"{_show(repr(text))}")
    return list(dict.fromkeys(positive_int(p) for p in parts))


def name_list(choices: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """A comma-separated, non-empty list of names from ``choices`` (repeats dropped, order kept)."""

    def parse(text: str) -> tuple[str, ...]:
        names = [n for n in text.replace(" ", "").lower().split(",") if n]
        if not names:
            raise argparse.ArgumentTypeError(f"expected some of {','.join(choices)}, got {_show(repr(text))}: "
                                             "an empty run")
        unknown = [n for n in names if n not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {_show(', '.join(map(repr, unknown)))}: choose from "
                                             f"{', '.join(choices)}")
        return tuple(dict.fromkeys(names))

    parse.__name__ = "list of names"
    return parse


def torch_device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` (whether that device exists is checked when the tool runs)."""
    value = text.strip().lower()
    if not re.fullmatch(r"cpu|cuda(:\d{1,4})?", value):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {_show(repr(text))}")
    return value


def plot_path(text: str) -> str:
    """A file to write a plot to: its folder must exist and be writable, so a long run does not end in an error,
    and its extension must be one matplotlib writes without extra packages."""
    path = os.path.abspath(os.path.expanduser(text))
    folder = os.path.dirname(os.path.realpath(path))  # a link's target's: where the plot will be written
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"no such folder: {folder}")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write to folder {folder}")
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name such as {text.rstrip('/')}/plot.png")
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext not in PLOT_FORMATS:
        raise argparse.ArgumentTypeError(f"the file name must end in {', '.join('.' + f for f in PLOT_FORMATS)}, "
                                         f"got {text!r}")
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError("plots need matplotlib: pip install 'hisparse[plot]'")
    return text
