"""The CUDA kernels on the CPU (tests/kernel_harness): the real cuda/*.cu files compiled as C++ with a shim,
threads as fibers in randomized schedules, checked byte for byte against the Rust reference on random and corrupt
cases, and the mutation check: removing any barrier, or moving any bound the kernels check by one, must make the
suite fail.

Needs g++ (nothing else: no GPU, no CUDA toolkit). Run with -s to see the suite's and the mutants' reports.
``HISPARSE_HARNESS_ROUNDS`` sets the suite's rounds (default 4).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("cuda.bindings")
if shutil.which(os.environ.get("CXX", "g++")) is None:
    pytest.skip("the kernel harness needs g++", allow_module_level=True)

from kernel_harness import SELFTEST, Harness, HarnessError, build  # noqa: E402
from kernel_harness.cases import KINDS  # noqa: E402

from hisparse.kernels.compiler import KERNELS  # noqa: E402
from hisparse.kernels.ops import KernelLaunch  # noqa: E402

TESTS = Path(__file__).resolve().parent
ROUNDS = int(os.environ.get("HISPARSE_HARNESS_ROUNDS", "4"))


def _module(name: str, *args: str, timeout: int) -> dict:
    """Runs ``python -m kernel_harness.<name>`` (crash-isolated) and returns its JSON report."""
    proc = subprocess.run([sys.executable, "-m", f"kernel_harness.{name}", *args], capture_output=True, text=True,
                          cwd=TESTS, timeout=timeout)
    assert proc.stdout.strip(), f"kernel_harness.{name} reported nothing (status {proc.returncode}):\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def selftest() -> Harness:
    return Harness(build(extra=SELFTEST))


def _ints(*values: int) -> list[ctypes.c_int32]:
    return [ctypes.c_int32(v) for v in values]


def _run(h: Harness, kernel: str, threads: int, out: torch.Tensor, *ints: int, smem: int = 0, seed: int = 0) -> None:
    args = (ctypes.c_uint64(out.data_ptr()), *_ints(*ints))
    h.run([KernelLaunch(kernel, (1, 1), threads, smem, args)], seed=seed, preempt=0.1)


def test_the_library_holds_every_kernel(selftest):
    assert all(selftest.has_kernel(k) for ks in KERNELS.values() for k in ks)
    assert not selftest.has_kernel("hisparse_no_such_kernel")


def test_warp_intrinsics_and_scans_compute_what_cuda_does(selftest):
    n = 128
    out = selftest.tensor(torch.full((n, 8), -1, dtype=torch.int32))
    _run(selftest, "selftest_intrinsics", n, out)
    t = torch.arange(n)
    lane = t % 32
    prefix = torch.cumsum(t % 3, 0) - t % 3
    ballot = sum(1 << b for b in range(0, 32, 5))
    peers = (0xF << (lane // 4 * 4)).to(torch.int64)
    up = torch.where(lane >= 3, t - 3, t)
    down = torch.where(lane + 2 < 32, t + 2, t)
    idx_x = (t - lane + 7) * 1000 + (t - lane + (lane ^ 5))
    want = torch.stack([prefix, torch.full((n,), int((t % 3).sum())), torch.full((n,), ballot),
                        peers, up, down, idx_x, torch.ones(n, dtype=torch.int64)], dim=1)
    assert torch.equal(out.to(torch.int64) & 0xFFFFFFFF, want & 0xFFFFFFFF)
    selftest.free()


@pytest.mark.parametrize(
    "kernel, message",
    [
        ("selftest_divergent_barrier", "different barriers"),
        ("selftest_exit_before_barrier", "exited before it"),
        ("selftest_missing_lane", "deadlock"),
    ],
)
def test_misused_barriers_and_collectives_are_reported(selftest, kernel, message):
    out = selftest.tensor(torch.zeros(64, dtype=torch.int32))
    with pytest.raises(HarnessError, match=message):
        _run(selftest, kernel, 64, out)
    selftest.free()


def test_a_write_out_of_bounds_is_seen(selftest):
    out = selftest.tensor(torch.zeros(5, dtype=torch.int32))
    assert selftest.damaged() == 0
    _run(selftest, "selftest_out_of_bounds", 32, out, 5)
    assert selftest.damaged() == 1
    selftest.free()


def test_a_missing_barrier_is_seen_and_a_present_one_is_not(selftest):
    n = 256
    want = (torch.arange(n, dtype=torch.int32) + 1) % n
    wrong = 0
    for seed in range(10):
        for barrier in (1, 0):
            out = selftest.tensor(torch.zeros(n, dtype=torch.int32))
            _run(selftest, "selftest_neighbour", n, out, barrier, smem=4 * n, seed=seed)
            if barrier:
                assert torch.equal(out, want)
            else:
                wrong += not torch.equal(out, want)
            selftest.free()
    assert wrong == 10, "shared memory holds garbage until written: every run without the barrier goes wrong"


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_a_plain_read_modify_write_of_global_memory_is_a_race_and_an_atomic_is_not(selftest, mode):
    """The fibers never interleave inside ``x += 1``, so the sum comes out right either way: the race check sees
    two threads touch one word between barriers, one with a plain write, whatever the schedule."""
    n = 64
    out = selftest.tensor(torch.zeros(n + 1, dtype=torch.int32))
    if mode == 1:
        with pytest.raises(HarnessError, match="data race on global memory: thread .* byte 0 of a 260-byte buffer"):
            _run(selftest, "selftest_global_add", n, out, mode)
    else:
        _run(selftest, "selftest_global_add", n, out, mode)
        assert int(out[0]) == n and torch.equal(out[2:], torch.arange(1, n, dtype=torch.int32))
        assert int(out[1]) == (n if mode == 2 else 0)
        (cta,) = selftest.counts[-1][1]
        assert cta.barriers == 1 and cta.atomics == n
        # n atomics (4 bytes read and written each), n words written; then thread 0 reads 4 bytes and writes 4
        assert cta.read_bytes == 4 * n + 4 * (mode == 2) and cta.written_bytes == 8 * n + 4 * (mode == 2)
    selftest.free()


def test_a_warp_running_ahead_exposes_a_missing_barrier_between_scans(selftest):
    """What uniform scheduling almost never does: the priority policies let one warp run through a second scan
    before a slow warp has read the first scan's result."""
    n = 1024
    t = torch.arange(n, dtype=torch.int32)
    want = t * 10000 + 2 * t
    runs = []
    for seed in range(12):
        out = selftest.tensor(torch.zeros(n, dtype=torch.int32))
        _run(selftest, "selftest_scan_twice", n, out, seed=seed)
        runs.append(torch.equal(out, want))
        selftest.free()
    assert not all(runs), "no schedule let a warp run ahead"


def test_kernels_match_the_reference_on_random_and_corrupt_cases():
    report = _module("run", "--rounds", str(ROUNDS), timeout=900)
    print(f"\nkernel harness: {report['cases']} cases of {report['kinds']} kinds in {report['seconds']} s, "
          f"scheduler {report['scheduler']}")
    assert report["kinds"] == len(KINDS)
    assert not report["failures"], json.dumps(report["failures"], indent=1)


def test_every_mutant_of_a_barrier_or_a_bound_makes_the_suite_fail():
    report = _module("mutate", timeout=1200)
    print(f"\nmutants: {report['caught']} of {report['mutants_total']} caught ({report['barriers']} barriers removed, "
          f"{report['semantic']} bounds moved) in {report['seconds']} s")
    for m in report["mutants"]:
        print(f"  {m['file']}:{m['line']}  {m['mutant'][:44]:44s}  {'caught' if m['caught'] else 'MISSED'}  "
              f"{m['how'][:80]}")
    assert report["barriers"] >= 20 and report["semantic"] >= 15
    missed = [f"{m['file']}:{m['line']} ({m['mutant']})" for m in report["mutants"] if not m["caught"]]
    assert not missed, f"mutants the suite does not see: {missed}"


def test_the_harness_counts_barriers_and_global_bytes_per_request():
    """benches/resolve_budget.py on one request per case: every case bit-exact with the reference, its counts
    positive and plausible (at least the top-K it must read, the row ids it must write, and for misses the rows
    it copies), and the footprint never above the traffic it comes from."""
    proc = subprocess.run([sys.executable, str(TESTS.parent / "benches" / "resolve_budget.py"), "--batch", "1"],
                          capture_output=True, text=True, timeout=600)
    assert proc.stdout.strip(), f"resolve_budget.py reported nothing (status {proc.returncode}):\n{proc.stderr}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    top_k = report["shape"]["top_k"]
    assert report["all_matched"], json.dumps(report["cases"], indent=1)
    assert set(report["cases"]) == {"hit_only_h4096", "hit_only_h10240", "hit_only_h32768", "resident_only",
                                    "miss20_h4096", "resident_unflagged", "mtp5_1m_hash", "mtp5_1m_windowed"}
    for name, case in report["cases"].items():
        if not case["ran"]:
            assert name == "hit_only_h32768" and case["why"], case  # only the largest may not fit shared memory
            continue
        assert case["matched"], case
        assert 1 <= case["barriers_per_request"] < 1000, case
        assert case["read_bytes_per_request"] >= 4 * top_k, case  # the request's top-K
        assert case["written_bytes_per_request"] >= 4 * top_k, case  # its row ids
        assert case["global_bytes_per_request"] <= case["access_bytes_per_request"], case
    miss = report["cases"]["miss20_h4096"]
    copied = round(0.2 * top_k) * report["shape"]["row_bytes"]
    assert miss["read_bytes_per_request"] >= copied and miss["written_bytes_per_request"] >= copied, miss
    hit = report["cases"]["hit_only_h4096"]
    assert hit["written_bytes_per_request"] < copied, "a hit-only step copies no row"
    assert [launch["kernel"] for launch in hit["launches"]] == ["hisparse_resolve"], "no launch after resolve"
    # The hit path's budget at H = 10,240 (issue 17): <= 6 barriers and <= 128 KB a request.
    h10k = report["cases"]["hit_only_h10240"]
    assert h10k["barriers_per_request"] <= 6 and h10k["global_bytes_per_request"] <= 128 * 1024, h10k
    # A request flagged resident takes the resident path: phase A's two barriers, one fewer than unflagged.
    flagged, unflagged = report["cases"]["resident_only"], report["cases"]["resident_unflagged"]
    assert flagged["barriers_per_request"] == 2 < unflagged["barriers_per_request"], (flagged, unflagged)
    # The bucketed path at 1M tokens on a 99 KB part runs buckets, at most twice the barriers of the same shape on
    # 227 KB, which hashes (issue 17).
    assert report["cases"]["mtp5_1m_windowed"]["buckets"] > 1 and "buckets" not in report["cases"]["mtp5_1m_hash"]
    assert report["targets"]["bucketed_barriers_vs_hash"]["met"], report["targets"]
