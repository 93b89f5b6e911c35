"""resolve's budget per request, counted on the CPU kernel harness (no GPU): barriers executed and global memory
moved, for the decode shape of ``kernel_bench.py``. Prints one JSON line.

Each case builds requests like ``kernel_bench.py`` does (top-K 2048, 64-token blocks, one layer of 656-byte rows,
no position twice in a row's selection), runs one resolve call (``ops.resolve_launches``: ``hisparse_resolve``,
which copies its misses itself) through the harness (``tests/kernel_harness``: the real ``cuda/*.cu`` as C++,
every load and store of a guarded buffer counted) and compares every byte with the Rust reference (``matched``).
The cases:

- ``hit_only_h4096``, ``hit_only_h10240``, ``hit_only_h32768``: every selected position cached in a hot region of
  H rows (32K-token requests; 64K for H = 32,768), nothing resident;
- ``resident_only``: every page resident on the GPU (H = 4,096), so no position reaches the hot region, and the
  request flagged resident (SPEC.md's ``resident``, which the core sets in the plan): the resident path;
- ``miss20_h4096``: 20% of each request's positions absent from its hot region (410 misses);
- ``resident_unflagged``: ``resident_only`` without the flag, as an integration that does not carry it resolves it;
- ``mtp5_1m_hash``, ``mtp5_1m_windowed``: requests of 5 batch rows (MTP 4) at 1M tokens selecting 10,240 distinct
  positions, every one cached in a hot region of 10,240 rows; on a 227 KB part (sm_90: the hash table takes the
  whole selection) and on a 99 KB part (sm_120: the table is clamped below the selection, so the request takes
  the bucketed path, formerly windows of positions: first occurrences and hits bucket by bucket, each bucket a
  range of positions that fits the table, cut from a histogram of the selection: ``buckets`` per request, as
  :func:`buckets` works them out).

Per case, over the call's requests (means):

- ``barriers_per_request``: barriers the resolve launch executed (each once per CTA, however many threads wait
  at it);
- ``global_bytes_per_request``: global memory the whole call (every launch of it) moves, as the distinct
  4-byte words each CTA read plus those it wrote (an atomic's word in both), in bytes: what DRAM would see if
  every re-read of a word hit a cache;
- ``access_bytes_per_request``: every load and store (atomics as both), re-reads included, as g++ -O2 emits them
  for the source (a GPU compiler may keep a value in a register where g++ reloads it, or the reverse; 32 lanes
  that load one word count 32 times): the traffic the kernel issues to its caches;
- ``launches``: each launch apart (CTAs, barriers, bytes, atomics).

Global memory is what the kernels are given: the state tensors, top-K, the output, the plan, the slab and host
pool, the layer table; never shared memory.

A case that the launch arithmetic refuses (shared memory) reports ``ran: false`` and why, instead of failing.
``targets`` holds issue 17's CPU budgets against the counts: a hit-only request at H = 10,240 (<= 6 barriers,
<= 128 KB), and the bucketed path at most twice the hash path's barriers (``mtp5_1m_windowed`` against
``mtp5_1m_hash``).

    PYTHONPATH=python python benches/resolve_budget.py [--batch N] [--seed S] [--cases a,b]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kernel_harness import Harness, HarnessError, build  # noqa: E402
from kernel_harness.cases import run_resolve  # noqa: E402

from hisparse.errors import ConfigError  # noqa: E402
from hisparse.kernels.launch import SHARED_MEMORY_PER_BLOCK, resolve_shared  # noqa: E402

TOP_K = 2048
ROW_BYTES = 656
BLOCK_SIZE = 64
HOST_BLOCKS = 256  # pages share host blocks beyond this (a host copy is only read)
TARGETS = {"barriers_per_request": 6, "global_bytes_per_request": 128 * 1024}  # hit_only_h10240
BUCKETED_VS_HASH = 2.0  # mtp5_1m_windowed's barriers per request over mtp5_1m_hash's, at most
CASES = {
    "hit_only_h4096": {"hot_rows": 4096, "miss_rate": 0.0},
    "hit_only_h10240": {"hot_rows": 10240, "miss_rate": 0.0},
    "hit_only_h32768": {"hot_rows": 32768, "miss_rate": 0.0, "seq_len": 65536},
    "resident_only": {"hot_rows": 4096, "miss_rate": 0.0, "resident": True, "flagged": True},
    "miss20_h4096": {"hot_rows": 4096, "miss_rate": 0.2},
    "resident_unflagged": {"hot_rows": 4096, "miss_rate": 0.0, "resident": True},
    "mtp5_1m_hash": {"hot_rows": 10240, "miss_rate": 0.0, "seq_len": 1 << 20, "rows": 5, "smem": "sm_90"},
    "mtp5_1m_windowed": {"hot_rows": 10240, "miss_rate": 0.0, "seq_len": 1 << 20, "rows": 5, "smem": "sm_120"},
}


def make_case(*, hot_rows: int, miss_rate: float, batch: int, seed: int, seq_len: int = 32768,
              resident: bool = False, flagged: bool = False, rows: int = 1, smem: str = "sm_90") -> dict:
    """CPU state and inputs of ``batch`` requests of ``rows`` batch rows each (the shape of
    ``kernel_bench.build``; no position twice in a request's selection)."""
    gen = torch.Generator().manual_seed(seed)
    pages = seq_len // BLOCK_SIZE
    hb = -(-hot_rows // BLOCK_SIZE)
    selected = rows * TOP_K
    misses = round(miss_rate * selected)
    hot_pos = torch.empty(batch, 1, hot_rows, dtype=torch.int32)
    hot_stamp = torch.empty(batch, 1, hot_rows, dtype=torch.int64)
    topk = torch.empty(batch * rows, TOP_K, dtype=torch.int32)
    for r in range(batch):
        order = torch.randperm(seq_len, generator=gen).int()
        cached, absent = order[:hot_rows], order[hot_rows:]
        hot_pos[r, 0] = cached
        hot_stamp[r, 0] = torch.randperm(hot_rows, generator=gen)  # distinct stamps in random order
        chosen = torch.cat([cached[: selected - misses], absent[:misses]])
        topk[r * rows:(r + 1) * rows] = chosen[torch.randperm(selected, generator=gen)].view(rows, TOP_K)
    hot_blocks = 1 + torch.arange(batch * hb, dtype=torch.int32).view(batch, hb)
    gpu_blocks = 1 + batch * hb
    block_table = torch.zeros(batch, pages, dtype=torch.int32)
    if resident:
        block_table = gpu_blocks + torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
        gpu_blocks += batch * pages
    flags = {"resident": torch.ones(batch, dtype=torch.uint8)} if flagged else {}
    return {
        **flags,
        "topk": topk,
        "row_state": torch.arange(batch, dtype=torch.int32).repeat_interleave(rows),
        "seq_lens": torch.full((batch,), seq_len, dtype=torch.int32),
        "block_table": block_table,
        "host_table": torch.arange(batch * pages, dtype=torch.int32).view(batch, pages) % HOST_BLOCKS,
        "hot_blocks": hot_blocks,
        "hot_pos": hot_pos,
        "hot_stamp": hot_stamp,
        "hot_clock": torch.zeros(batch, 1, dtype=torch.int64),
        "heat": torch.zeros(batch, pages, dtype=torch.int32),
        "status": torch.zeros(batch, dtype=torch.int32),
        "counters": torch.zeros(3, dtype=torch.int64),
        "gpu_layers": [torch.zeros(gpu_blocks * BLOCK_SIZE, ROW_BYTES, dtype=torch.uint8)],
        "host_layers": [torch.randint(0, 256, (HOST_BLOCKS * BLOCK_SIZE, ROW_BYTES), dtype=torch.uint8,
                                      generator=gen)],
        "block_size": BLOCK_SIZE,
    }


def buckets(positions: torch.Tensor, length: int, limit: int) -> int:
    """The buckets resolve's bucketed path takes for one request's selection (``bucket_end`` in cuda/resolve.cu):
    256 bins over [0, length), each bounding its distinct positions by min(its elements, its width); a bucket takes
    whole bins while their bounds add up to at most ``limit``, and a bin past it goes in ranges of ``limit``."""
    shift = max(0, (length - 1).bit_length() - 8)
    valid = positions[(positions >= 0) & (positions < length)].long()
    bound = torch.bincount(valid >> shift, minlength=256).clamp(max=1 << shift).tolist()
    n, lo = 0, 0
    while lo < length:
        b = lo >> shift
        if bound[b] > limit:
            hi = min(lo + limit, (b + 1) << shift, length)
        else:
            total, e = bound[b], b + 1
            while e < 256 and bound[e] <= limit and total + bound[e] <= limit:
                total, e = total + bound[e], e + 1
            hi = min(e << shift, length)
        n, lo = n + 1, hi
    return n


def measure(h: Harness, name: str, batch: int, seed: int) -> dict:
    """One case: resolve on the harness against the reference, and its counts per request."""
    params = CASES[name]
    case = make_case(**params, batch=batch, seed=seed)
    began = time.monotonic()
    rows, smem = params.get("rows", 1), SHARED_MEMORY_PER_BLOCK[params.get("smem", "sm_90")]
    row = {"hot_rows": params["hot_rows"], "seq_len": int(case["seq_lens"][0]), "requests": batch,
           "rows_per_request": rows, "smem": params.get("smem", "sm_90")}
    try:
        shared = resolve_shared(top_k=TOP_K, hot_rows=params["hot_rows"], batch_rows=batch * rows,
                                rows_per_request=rows, limit=smem)
        if shared.fast_positions < rows * TOP_K:  # the selection's distinct positions past the table: buckets
            per_request = case["topk"].view(batch, rows * TOP_K)
            row["buckets"] = max(buckets(p, row["seq_len"], shared.fast_positions) for p in per_request)
        row["table_entries"] = shared.capacity
        run_resolve(h, case, group=0, seed=seed, preempt=0.05, max_smem=smem, rows_per_request=rows)
        matched, error = True, None
    except ConfigError as e:
        h.free()
        return {**row, "ran": False, "why": str(e)}
    except (AssertionError, HarnessError) as e:
        matched, error = False, str(e)[:300]
    launches = []
    for kernel, ctas in h.counts:
        launches.append({
            "kernel": kernel,
            "ctas": len(ctas),
            "barriers": sum(c.barriers for c in ctas),
            "read_bytes": sum(c.read_footprint for c in ctas),
            "written_bytes": sum(c.written_footprint for c in ctas),
            "access_bytes": sum(c.read_bytes + c.written_bytes for c in ctas),
            "atomics": sum(c.atomics for c in ctas),
        })
    h.free()
    resolve = [x for x in launches if x["kernel"] == "hisparse_resolve"]
    read = sum(x["read_bytes"] for x in launches)
    written = sum(x["written_bytes"] for x in launches)
    row |= {
        "ran": bool(launches),
        "matched": matched,
        "barriers_per_request": round(sum(x["barriers"] for x in resolve) / batch, 2),
        "global_bytes_per_request": round((read + written) / batch),
        "read_bytes_per_request": round(read / batch),
        "written_bytes_per_request": round(written / batch),
        "access_bytes_per_request": round(sum(x["access_bytes"] for x in launches) / batch),
        "launches": launches,
        "seconds": round(time.monotonic() - began, 1),
    }
    if error:
        row["error"] = error
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=2, help="requests per case (one batch row each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", default="", help="comma-separated cases (default: all)")
    args = p.parse_args(argv)
    names = [c for c in args.cases.split(",") if c] or list(CASES)
    unknown = set(names) - set(CASES)
    if unknown:
        p.error(f"unknown cases {sorted(unknown)}")
    torch.set_num_threads(1)
    h = Harness(build())
    h.track_footprint(True)
    results = {name: measure(h, name, args.batch, args.seed + i) for i, name in enumerate(names)}
    ran = [r for r in results.values() if r["ran"]]
    budget = results.get("hit_only_h10240", {})
    targets = {k: {"case": "hit_only_h10240", "target": v, "measured": budget.get(k),
                   "met": None if budget.get(k) is None else budget[k] <= v} for k, v in TARGETS.items()}
    hashed, bucketed = (results.get(k, {}).get("barriers_per_request") for k in ("mtp5_1m_hash", "mtp5_1m_windowed"))
    ratio = None if hashed is None or bucketed is None else round(bucketed / hashed, 2)
    targets["bucketed_barriers_vs_hash"] = {"case": "mtp5_1m_windowed", "target": BUCKETED_VS_HASH, "measured": ratio,
                                            "met": None if ratio is None else ratio <= BUCKETED_VS_HASH}
    report = {
        "shape": {"top_k": TOP_K, "block_size": BLOCK_SIZE, "row_bytes": ROW_BYTES, "layers": 1, "batch": args.batch},
        "all_matched": bool(ran) and all(r["matched"] for r in ran),
        "targets": targets,
        "cases": results,
    }
    print(json.dumps(report))
    return 0 if report["all_matched"] else 1


if __name__ == "__main__":
    sys.exit(main())
