"""The barrier-mutation check: every ``__syncthreads();`` of ``cuda/`` removed in turn; each mutant is built and
run through the suite until a case fails. A mutant the suite does not catch is a barrier whose removal the
harness cannot see: either the barrier is not needed (remove it from the kernel) or the suite misses a case.

    python -m kernel_harness.mutate [--rounds N] [--jobs J]

(from ``tests/``) prints one JSON object: per barrier, its file and line, whether it was caught and how. Each
mutant runs in a child forked from this process (torch and the reference already loaded, one thread), so that a
mutant that faults or hangs takes down only its child.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

from kernel_harness import CUDA_DIR, Harness, build
from kernel_harness.cases import KINDS
from kernel_harness.run import run_suite

BARRIER = re.compile(r"\b__syncthreads\(\);")
MUTANT_SECONDS = 90  # a mutant that hangs (a probe of a table nobody cleared) is caught by the clock


def barriers(cuda_dir: Path = CUDA_DIR) -> list[tuple[str, int, int]]:
    """(file name, offset, line) of every __syncthreads(); statement."""
    out = []
    for f in sorted(cuda_dir.glob("*.cu*")):
        text = f.read_text()
        out += [(f.name, m.start(), text.count("\n", 0, m.start()) + 1) for m in BARRIER.finditer(text)]
    return out


def mutant(name: str, offset: int, workdir: Path) -> Path:
    """A copy of cuda/ with the barrier at ``offset`` of ``name`` removed; returns its built library."""
    folder = Path(tempfile.mkdtemp(prefix=f"{name}-{offset}-", dir=workdir))
    for f in CUDA_DIR.glob("*.cu*"):
        shutil.copy(f, folder / f.name)
    text = (folder / name).read_text()
    rest = text[offset + len("__syncthreads();"):]
    (folder / name).write_text(text[:offset] + "/* mutant: barrier removed */;" + rest)
    return build(folder, folder=workdir / "objects")


def start_child(library: Path, rounds: int) -> tuple[int, int]:
    """Forks a child that runs the suite on ``library`` and writes its report to a pipe; returns (pid, fd)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read)
        code = 1
        try:
            report = run_suite(Harness(library), list(KINDS), rounds, first_failure=True)
            os.write(write, json.dumps(report).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    return pid, read


def finish_child(pid: int, fd: int, deadline: float) -> tuple[str, dict | None]:
    """Waits for the child (killing it at the deadline); returns (how it ended, its report)."""
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(fd)
            return "timeout (the mutant hangs)", None
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            data = os.read(fd, 1 << 16)
            if not data:
                break
            chunks.append(data)
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"the suite died ({signal.Signals(os.WTERMSIG(status)).name})", None
    if not chunks:
        return f"the suite failed to report (exit status {os.WEXITSTATUS(status)})", None
    return "report", json.loads(b"".join(chunks))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=4, help="suite rounds before a mutant counts as not caught")
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # no thread pool in the children a fork copies this process into
    os.environ["HS_LAUNCH_SECONDS"] = "30"
    start = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="hisparse-mutants-") as tmp:
        workdir = Path(tmp)
        build(folder=workdir / "objects")  # the objects every mutant shares, built once
        todo = barriers()
        running: list[tuple[dict, int, int, float]] = []
        while todo or running:
            while todo and len(running) < args.jobs:
                name, offset, line = todo.pop(0)
                pid, fd = start_child(mutant(name, offset, workdir), args.rounds)
                running.append(({"file": name, "line": line}, pid, fd, time.monotonic()))
            entry, pid, fd, began = running.pop(0)
            how, report = finish_child(pid, fd, began + MUTANT_SECONDS)
            entry["seconds"] = round(time.monotonic() - began, 1)
            if report is None:
                entry.update(caught=True, how=how)
            elif report["failures"]:
                first = report["failures"][0]
                entry.update(caught=True, cases=report["cases"],
                             how=f"{first['kind']} (seed {first['seed']}): {first['error'][:200]}")
            else:
                entry.update(caught=False, how=f"{report['cases']} cases passed")
            results.append(entry)
    results.sort(key=lambda e: (e["file"], e["line"]))
    report = {
        "barriers": len(results),
        "caught": sum(r["caught"] for r in results),
        "seconds": round(time.monotonic() - start, 1),
        "mutants": results,
    }
    print(json.dumps(report))
    return 0 if report["caught"] == report["barriers"] else 1


if __name__ == "__main__":
    sys.exit(main())
