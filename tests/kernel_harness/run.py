"""Runs the harness suite and prints one JSON object: cases run per kind, failures, scheduler statistics.

    python -m kernel_harness.run [--library PATH] [--rounds N] [--seed S] [--first-failure] [--kinds a,b]

(from ``tests/``). Round r runs every kind once with seed ``S + r`` and a preemption probability that cycles
through 0, 0.05 and 0.3; slow kinds run in the first round only. The exit status is 1 when a case failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kernel_harness import Harness, HarnessError, build
from kernel_harness.cases import KINDS, SLOW

PREEMPT = (0.0, 0.05, 0.3)


def run_suite(h: Harness, kinds: list[str], rounds: int, seed: int = 0, first_failure: bool = False,
              progress: Callable[[], None] | None = None) -> dict:
    """Runs the kinds for ``rounds`` rounds on ``h``; returns the report (see the module docstring). ``progress``
    is called after every case (the mutation check tells a hung mutant from a slow suite by it)."""
    start = time.monotonic()
    runs: dict[str, int] = {}
    failures = []
    for r in range(rounds):
        for i, kind in enumerate(kinds):
            if r > 0 and kind in SLOW:
                continue
            case_seed = seed + r * 1000 + i
            preempt = PREEMPT[(r + i) % len(PREEMPT)]
            try:
                KINDS[kind](h, case_seed, preempt)
            except Exception as e:  # a mismatch, a misused barrier, or a case that could not run: all fail
                what = "" if isinstance(e, (AssertionError, HarnessError)) else f"{type(e).__name__}: "
                failures.append({"kind": kind, "seed": case_seed, "preempt": preempt, "error": (what + str(e))[:600]})
            finally:
                h.free()
            runs[kind] = runs.get(kind, 0) + 1
            if progress is not None:
                progress()
            if failures and first_failure:
                break
        if failures and first_failure:
            break
    return {
        "cases": sum(runs.values()),
        "kinds": len(runs),
        "failures": failures,
        "seconds": round(time.monotonic() - start, 1),
        "scheduler": h.stats(),
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--library", type=Path, help="a built harness library (default: build the repository's)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--first-failure", action="store_true", help="stop at the first failing case")
    p.add_argument("--kinds", default="", help="comma-separated kinds (default: all)")
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k] or list(KINDS)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        p.error(f"unknown kinds {sorted(unknown)}")
    report = run_suite(Harness(args.library or build()), kinds, args.rounds, args.seed, args.first_failure)
    print(json.dumps(report))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
