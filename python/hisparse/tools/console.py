"""What every command-line tool prints with: aligned tables, one progress line on stderr, byte sizes, and the
memory check a tool runs before it builds anything large."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO

from ..errors import ConfigError


def format_table(rows: Sequence[Sequence[str]], *, head: Sequence[str] | None = None, align: str = "",
                 indent: str = "", rule: bool = False) -> str:
    """Rows of cells padded into columns. ``align`` has one letter per column, ``l`` or ``r`` (missing: ``l``);
    ``rule`` draws dashes under ``head``. The last column is not padded when it is left-aligned."""
    table = [list(head)] if head is not None else []
    table += [list(r) for r in rows]
    if not table:
        return ""
    cols = max(len(r) for r in table)
    widths = [max(len(r[i]) for r in table if i < len(r)) for i in range(cols)]
    right = [i < len(align) and align[i] == "r" for i in range(cols)]

    def line(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=False)]
        return (indent + "  ".join(out)).rstrip()

    lines = [line(r) for r in table]
    if head is not None and rule:
        lines.insert(1, indent + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_bytes(n: float) -> str:
    """Decimal units, as disks and links are sold: ``512 B``, ``3.3 MB``, ``17.0 GB``."""
    if abs(n) < 1000:
        return f"{n:.0f} B"
    for unit in ("KB", "MB", "GB"):
        n /= 1000
        if abs(n) < 1000:
            return f"{n:.1f} {unit}"
    return f"{n / 1000:.3g} TB"


class Progress:
    """A run's progress on stderr. On a terminal: one line, redrawn in place at most 10 times a second. Elsewhere
    (a log, a pipe): nothing while the run is younger than ``QUIET_S`` seconds, so a short run prints nothing;
    after that a line at once, then at each ``start``, each quarter done and at least every ``EVERY_S`` seconds
    while the run reports. ``update(fraction, note)``; ``close()`` ends the line."""

    WIDTH = 30
    QUIET_S = 2.0
    EVERY_S = 5.0
    clock = staticmethod(time.perf_counter)  # tests make a run slow by replacing it

    def __init__(self, enabled: bool = True, stream: TextIO | None = None):
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.label = ""
        self.born = self.t0 = self.last = self.clock()
        self.quarter = -1
        self.open = False

    def start(self, label: str, note: str = "") -> None:
        self.close()
        self.label, self.t0, self.quarter = label, self.clock(), -1
        self.update(0.0, note, force=True)

    def update(self, fraction: float, note: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        now = self.clock()
        fraction = min(1.0, max(0.0, fraction))
        quarter = int(4 * fraction)
        if self.tty:
            if not force and fraction < 1.0 and now - self.last < 0.1:
                return
        elif now - self.born < self.QUIET_S:
            return
        elif not force and quarter == self.quarter and now - self.last < self.EVERY_S:
            return
        self.last, self.quarter = now, quarter
        fill = int(self.WIDTH * fraction)
        line = f"{self.label:<10} [{'#' * fill}{'.' * (self.WIDTH - fill)}] {note}  {now - self.t0:6.1f} s"
        self.stream.write("\r" + line if self.tty else line + "\n")
        self.stream.flush()
        self.open = self.tty

    def close(self) -> None:
        if self.open:
            self.stream.write("\n")
            self.stream.flush()
            self.open = False


def available_memory() -> int | None:
    """Bytes the kernel says a new process can use without swapping (Linux ``MemAvailable``); ``None`` where
    that is unknown, and then no memory check is made."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def require_memory(need: float, what: str, advice: str) -> None:
    """Refuses a run whose estimated memory ``need`` (bytes; ``what`` says of what) is more than this machine has
    available, before anything is built. ``advice`` says which flags to change."""
    have = available_memory()
    if have is not None and need > have:
        size = f"about {format_bytes(need)} of" if need < float("inf") else "unbounded"
        raise ConfigError(f"this run needs {size} memory ({what}), more than the {format_bytes(have)} available: "
                          f"{advice}")


def print_then_plot(results: str, plot_path: str | None, draw: Callable[[str], None], *, say_where: bool) -> None:
    """Prints a run's results, then writes its plot (``draw(plot_path)``, when one was asked for): the results
    first, so that a plot that cannot be written (its folder checked before the run, gone by its end) loses
    nothing, and the plot even when stdout's reader has left (``| head``). A plot that cannot be written is a
    :class:`ConfigError` naming ``--plot``."""
    try:
        print(results, flush=True)
    finally:
        if plot_path:
            try:
                draw(plot_path)
            except OSError as exc:
                raise ConfigError(f"--plot {plot_path}: the plot could not be written: {exc}") from None
    if plot_path and say_where:
        print(f"plot written to {plot_path}")
