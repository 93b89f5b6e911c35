"""The mutation check: each mutant of ``cuda/`` is built and run through the suite until a case fails.

- every ``__syncthreads();`` removed in turn;
- every ``__syncthreads_or(x)`` replaced by the thread's own ``(x)`` (no barrier, no block-wide OR);
- ``SEMANTIC``: each bound the kernels check moved by one (``>=`` to ``>``...), the hot-block checks undone, the
  bucketed path's buckets one position too wide or too narrow and its claims and entries miswritten, atomics on
  shared global words made plain ``+=``, and the LRU's stamps misordered, misselected or miswritten.

A mutant the suite does not catch is a barrier whose removal the harness cannot see (the barrier is not needed,
or the suite misses a case), a bound that no case draws at its exact value, or a race the harness's race check
on global memory (runtime.cpp) misses.

    python -m kernel_harness.mutate [--rounds N] [--jobs J]

(from ``tests/``) prints one JSON object: per mutant, its file, line and kind, whether it was caught and how.
Each mutant runs in a child forked from this process (torch and the reference already loaded, one thread), so
that a mutant that faults or hangs takes down only its child.
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
BARRIER_OR = re.compile(r"\b__syncthreads_or(?=\()")
# A mutant whose suite finishes no case in this long hangs (a probe of a table nobody cleared): caught by the clock.
# The limit is per case, not per suite: a mutant the suite misses runs every round, which takes longer than any
# one case, and must be reported as missed, not as hung.
CASE_SECONDS = 90

# (file, text, replacement, what): each text occurs once in its file (the check fails otherwise, so that an edit
# of the kernels cannot silently retire a mutant). Each must be caught by some case drawing the exact bound.
SEMANTIC = [
    ("copy.cu", "gpu >= gpu_rows || host >= host_rows) continue;\n    uint4* g",
     "gpu > gpu_rows || host >= host_rows) continue;\n    uint4* g", "copy_rows takes GPU row == rows"),
    ("copy.cu", "gpu >= gpu_rows || host >= host_rows) continue;\n    uint4* g",
     "gpu >= gpu_rows || host > host_rows) continue;\n    uint4* g", "copy_rows takes host row == rows"),
    ("copy.cu", "gpu >= gpu_blocks || host >= host_blocks", "gpu > gpu_blocks || host >= host_blocks",
     "copy_blocks takes GPU block == blocks"),
    ("copy.cu", "gpu >= gpu_blocks || host >= host_blocks", "gpu >= gpu_blocks || host > host_blocks",
     "copy_blocks takes host block == blocks"),
    ("copy.cu", "gpu >= gpu_rows || host >= host_rows) continue;\n    copy_span",
     "gpu > gpu_rows || host >= host_rows) continue;\n    copy_span", "replay takes GPU row == rows"),
    ("copy.cu", "gpu >= gpu_rows || host >= host_rows) continue;\n    copy_span",
     "gpu >= gpu_rows || host > host_rows) continue;\n    copy_span", "replay takes host row == rows"),
    ("copy.cu", "min(max(count[i], 0), K)", "min(max(count[i], 0), K + 1)", "replay clamps counts to K + 1"),
    ("copy.cu", "row < slab_rows", "row <= slab_rows", "gather reads row == rows"),
    ("resolve.cu", "if (r < 0 || r >= S) {", "if (r < 0 || r > S) {", "resolve takes state row == S"),
    ("resolve.cu", "min(max(raw_len, 0), P * bs)", "min(max(raw_len, 0), P * bs + 1)",
     "resolve takes seq_len == P * bs + 1"),
    ("resolve.cu", "min(max(raw_len, 0), P * bs)", "min(max(raw_len, -1), P * bs)", "resolve takes seq_len == -1"),
    ("resolve.cu", "pos >= 0 && pos < len ? pos : -1", "pos >= 0 && pos <= len ? pos : -1",
     "resolve takes position == seq_len"),
    ("resolve.cu", "b >= 0 && b < gpu_blocks ? b : -1", "b >= 0 && b <= gpu_blocks ? b : -1",
     "resolve takes block_table entry == gpu_blocks"),
    # The resident flag (SPEC.md): ignored (the hot region serves a flagged request's null blocks), trusted where the
    # table contradicts it (the null block read in place), its bound off by one, and its bad blocks flagged by one
    # lane's element alone.
    ("resolve.cu", "if (resident != nullptr && resident[r] != 0) {", "if (false) {",
     "resolve ignores the resident flag"),
    ("resolve.cu", "const bool in_slab = block > 0 && block < gpu_blocks;",
     "const bool in_slab = block >= 0 && block < gpu_blocks;",
     "resolve's resident path reads the null block in place"),
    ("resolve.cu", "const bool in_slab = block > 0 && block < gpu_blocks;",
     "const bool in_slab = block > 0 && block <= gpu_blocks;", "resolve's resident path takes block == gpu_blocks"),
    ("resolve.cu", "if (__any_sync(HS_FULL_MASK, pos >= 0 && !in_slab) && (threadIdx.x & 31) == 0)",
     "if (pos >= 0 && !in_slab && (threadIdx.x & 31) == 0)", "resolve's resident path flags lane 0's bad block only"),
    ("resolve.cu", "hb_row[b] <= 0 || hb_row[b] >= gpu_blocks;", "hb_row[b] <= 0 || hb_row[b] > gpu_blocks;",
     "resolve takes hot block == gpu_blocks"),
    ("resolve.cu", "bad |= (atomicOr(&seen[id >> 5], m) & m) != 0;", "atomicOr(&seen[id >> 5], m);",
     "resolve takes a hot block named twice"),
    ("resolve.cu", "w < (u32)gpu_blocks; w += window_ids", "w < window_ids; w += window_ids",
     "resolve checks the first window of hot blocks only"),
    ("resolve.cu", "host_block >= host_blocks ? HS_BAD_TABLE", "host_block > host_blocks ? HS_BAD_TABLE",
     "resolve takes host block == host_blocks"),
    # The bucketed path (more distinct positions than the table takes): a bucket that takes the position at its end
    # (the next bucket's first) or skips the one at its start; a second slot's claim of a position let through; an
    # entry that keeps the slot of the last step's plan for a miss; a resident position claimed as a hit.
    ("resolve.cu", "return (u32)pos - lo < hi - lo;", "return (u32)pos - lo <= hi - lo;",
     "a bucket takes the position at its end"),
    ("resolve.cu", "lo < (u32)len; lo = hi)", "lo < (u32)len; lo = hi + 1)",
     "a bucket skips the position at its start"),
    ("resolve.cu", "if (s_full) bad |= s_dup != 0;", "if (false) bad |= s_dup != 0;",
     "the bucketed path lets a second slot take a claimed position"),
    ("resolve.cu", "if (claim) ((u32*)entry(q))[1] = HS_NONE;", "",
     "the bucketed path takes the last plan's word for a miss's slot"),
    ("resolve.cu", "if (h == HS_NONE || block_of(pos) != 0) return;", "if (h == HS_NONE) return;",
     "the bucketed path's claims take a resident position for a hit"),
    # Plain read-modify-writes where threads (heat) or CTAs (counters) share a word: the fibers never interleave
    # inside one, so only the harness's race check on global memory sees them.
    ("resolve.cu", "atomicAdd(&heat_row[page], __popc(peers));", "heat_row[page] += __popc(peers);",
     "resolve adds heat with a plain += (threads race)"),
    ("resolve.cu", "atomicAdd(&counters[1], (u64)n_miss);", "counters[1] += (u64)n_miss;",
     "resolve counts misses with a plain += (CTAs race)"),
    ("resolve.cu", "j0 += per_round)", "j0 += per_round + 1)", "resolve's copies skip a row between rounds"),
    # The LRU as stamps: the order (ascending (stamp, slot)), the |M|-oldest select, the stamps a step writes.
    ("resolve.cu", "(other == key && j0 + b < c)", "(false)", "resolve's LRU select breaks ties by stamp alone"),
    ("resolve.cu", "return (u64)stamp ^ (1ull << 63);", "return (u64)stamp;",
     "resolve's LRU select orders stamps as unsigned (negative ones last)"),
    ("resolve.cu", "int left = count;", "int left = count + 1;", "resolve's LRU select takes the |M| + 1-th oldest"),
    ("resolve.cu", "(firsts & u_bit) hs[slot] = make_stamp(clock, q);",
     "(firsts & u_bit) hs[slot] = make_stamp(clock, gi);",
     "resolve's short path stamps with the batch-row index (gi), not the request's (q)"),
    ("resolve.cu", "(slot != HS_NONE) hs[slot] = make_stamp(clock, q);",
     "(slot != HS_NONE) hs[slot] = make_stamp(clock, gi);",
     "resolve's bucketed short path stamps with the batch-row index (gi), not the request's (q)"),
    ("resolve.cu", "hot_clock[(i64)r * G + g] = s_clock + 1;", "hot_clock[(i64)r * G + g] = s_clock;",
     "resolve leaves the region's clock where it was"),
    ("resolve.cu", "if (!((u32)mark & CLAIM_BIT) && atomicCAS", "if (atomicCAS",
     "resolve's short path lets a second slot take a claimed position"),
    ("resolve.cu", "mark & CLAIM_BIT ? mark & ~(U_BIT | CLAIM_BIT) : HS_NONE", "mark & ~(U_BIT | CLAIM_BIT)",
     "resolve's phase A2 takes a miss for a hit"),
    ("resolve.cu", "smallest == (i64)(1ull << 63) ? smallest : smallest - 1", "smallest - 1",
     "invalidate's stamp wraps below the smallest i64"),
    ("resolve.cu", "bad |= a < b && hb_row[a] == hb_row[b];", "bad |= a + 1 < b && hb_row[a] == hb_row[b];",
     "resolve's pairwise hot-block check skips neighbours"),
]


def mutants(cuda_dir: Path = CUDA_DIR) -> list[tuple[dict, str, str]]:
    """(label, file name, mutated text) of every mutant; raises if a SEMANTIC text is not found exactly once."""
    out = []
    texts = {f.name: f.read_text() for f in sorted(cuda_dir.glob("*.cu*"))}
    for name, text in texts.items():
        for pattern, replacement, what in ((BARRIER, "/* mutant: barrier removed */;", "__syncthreads() removed"),
                                           (BARRIER_OR, "/* mutant: no barrier */", "__syncthreads_or(x) -> (x)")):
            for m in pattern.finditer(text):
                mutated = text[:m.start()] + replacement + text[m.end():]
                out.append(({"file": name, "line": text.count("\n", 0, m.start()) + 1, "mutant": what}, name,
                            mutated))
    for name, old, new, what in SEMANTIC:
        text = texts[name]
        if text.count(old) != 1:
            raise ValueError(f"semantic mutant {what!r}: its text occurs {text.count(old)} times in {name}, not once")
        out.append(({"file": name, "line": text[:text.index(old)].count("\n") + 1, "mutant": what}, name,
                    text.replace(old, new)))
    return out


def build_mutant(name: str, text: str, workdir: Path) -> Path:
    """A copy of cuda/ with ``name`` holding ``text``; returns its built library."""
    folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=workdir))
    for f in CUDA_DIR.glob("*.cu*"):
        shutil.copy(f, folder / f.name)
    (folder / name).write_text(text)
    return build(folder, folder=workdir / "objects")


def start_child(library: Path, rounds: int) -> tuple[int, int]:
    """Forks a child that runs the suite on ``library`` and writes its report to a pipe; returns (pid, fd)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read)
        code = 1
        try:
            report = run_suite(Harness(library), list(KINDS), rounds, first_failure=True,
                               progress=lambda: os.write(write, b"."))
            os.write(write, json.dumps(report).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    return pid, read


def finish_child(pid: int, fd: int, case_seconds: float) -> tuple[str, dict | None]:
    """Waits for the child (killing it when it finishes no case in ``case_seconds``: a dot on the pipe per case,
    then the report); returns (how it ended, its report)."""
    chunks = []
    deadline = time.monotonic() + case_seconds
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
            deadline = time.monotonic() + case_seconds
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"the suite died ({signal.Signals(os.WTERMSIG(status)).name})", None
    if not chunks:
        return f"the suite failed to report (exit status {os.WEXITSTATUS(status)})", None
    return "report", json.loads(b"".join(chunks).lstrip(b"."))


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
        todo = mutants()
        running: list[tuple[dict, int, int, float]] = []
        while todo or running:
            while todo and len(running) < args.jobs:
                label, name, text = todo.pop(0)
                pid, fd = start_child(build_mutant(name, text, workdir), args.rounds)
                running.append((label, pid, fd, time.monotonic()))
            entry, pid, fd, began = running.pop(0)
            how, report = finish_child(pid, fd, CASE_SECONDS)
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
        "mutants_total": len(results),
        "barriers": sum(r["mutant"] == "__syncthreads() removed" for r in results),
        "semantic": len(SEMANTIC),
        "caught": sum(r["caught"] for r in results),
        "seconds": round(time.monotonic() - start, 1),
        "mutants": results,
    }
    print(json.dumps(report))
    return 0 if report["caught"] == report["mutants_total"] else 1


if __name__ == "__main__":
    sys.exit(main())
