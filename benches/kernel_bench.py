"""GPU benchmark of the data path's kernels: one ``ops.resolve`` call (the resolve kernel, then the copy of its
misses from pinned host memory spread over the GPU), the miss copy alone (``ops.replay`` of the same plan), and,
for scale, a bulk pinned host-to-device copy measured in the same run. Prints one JSON object.

Decode shape: top-K 2048, 656-byte rows (one layer), 64-token blocks, 32K-token requests, nothing resident on
the GPU, so every selected position is a hit or a miss of the hot region. Hot regions of H = 2x, 4x and 5x top-K;
batches of 1, 8, 32 and 128 requests; miss rates 0%, 20% and 100% (a miss rate m makes m * 2048 of each
request's positions absent from its hot region); and B = 100 at 20% (41,000 misses: SGLang publishes 669 us).
Every timed call starts from the same state (restored outside the timed region), so all calls do the same work.

    PYTHONPATH=python python benches/kernel_bench.py [--iters N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

TOP_K = 2048
ROW_BYTES = 656
BLOCK_SIZE = 64
SEQ_LEN = 32768
HOST_BLOCKS = 16384  # pages share host blocks beyond this (the pool would be 2.7 GiB at batch 128)
HOT_ROWS = (2 * TOP_K, 4 * TOP_K, 5 * TOP_K)
BATCHES = (1, 8, 32, 128)
MISS_RATES = (0.0, 0.2, 1.0)
CASES = [(h, b, m) for h in HOT_ROWS for b in BATCHES for m in MISS_RATES] + [(2 * TOP_K, 100, 0.2)]
QUICK = [(2 * TOP_K, b, m) for b in (1, 128) for m in (0.0, 0.2)] + [(2 * TOP_K, 100, 0.2)]
MUTABLE = ("hot_pos", "hot_lru", "heat", "status", "counters")


def build(hot_rows: int, batch: int, miss_rate: float, host_pool: torch.Tensor, seed: int) -> dict:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    pages = SEQ_LEN // BLOCK_SIZE
    hot_blocks_per_request = -(-hot_rows // BLOCK_SIZE)
    misses = round(miss_rate * TOP_K)
    hot_pos = torch.empty(batch, 1, hot_rows, dtype=torch.int32, device=dev)
    hot_lru = torch.empty_like(hot_pos)
    topk = torch.empty(batch, TOP_K, dtype=torch.int32, device=dev)
    for r in range(batch):
        order = torch.randperm(SEQ_LEN, generator=gen, device=dev).int()
        cached, absent = order[:hot_rows], order[hot_rows:]
        hot_pos[r, 0] = cached
        hot_lru[r, 0] = torch.randperm(hot_rows, generator=gen, device=dev).int()
        chosen = torch.cat([cached[: TOP_K - misses], absent[:misses]])
        topk[r] = chosen[torch.randperm(TOP_K, generator=gen, device=dev)]
    pages_all = torch.arange(batch * pages, dtype=torch.int32, device=dev).view(batch, pages)
    slab_rows = (1 + batch * hot_blocks_per_request) * BLOCK_SIZE
    return {
        "topk": topk,
        "row_state": torch.arange(batch, dtype=torch.int32, device=dev),
        "seq_lens": torch.full((batch,), SEQ_LEN, dtype=torch.int32, device=dev),
        "block_table": torch.zeros(batch, pages, dtype=torch.int32, device=dev),
        "host_table": pages_all % HOST_BLOCKS,
        "hot_blocks": 1 + torch.arange(batch * hot_blocks_per_request, dtype=torch.int32, device=dev).view(batch, -1),
        "hot_pos": hot_pos,
        "hot_lru": hot_lru,
        "heat": torch.zeros(batch, pages, dtype=torch.int32, device=dev),
        "status": torch.zeros(batch, dtype=torch.int32, device=dev),
        "counters": torch.zeros(3, dtype=torch.int64, device=dev),
        "gpu_layers": [torch.zeros(slab_rows, ROW_BYTES, dtype=torch.uint8, device=dev)],
        "host_layers": [host_pool],
        "group": 0,
        "block_size": BLOCK_SIZE,
        "out": torch.empty(batch, TOP_K, dtype=torch.int32, device=dev),
        "miss_plan": torch.empty(batch * TOP_K, 2, dtype=torch.int64, device=dev),
        "miss_count": torch.empty(batch, dtype=torch.int32, device=dev),
    }


def _time_us(fn, before, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times


def _summary(times: list[float], nbytes: int) -> dict:
    median = statistics.median(times)
    return {
        "median_us": round(median, 2),
        "min_us": round(min(times), 2),
        "p90_us": round(sorted(times)[int(0.9 * (len(times) - 1))], 2),
        "gb_per_s": round(nbytes / median / 1e3, 2),
    }


def measure(ops, args: dict, iters: int) -> dict:
    saved = {k: args[k].clone() for k in MUTABLE}

    def restore() -> None:
        for k in MUTABLE:
            args[k].copy_(saved[k])

    ops.resolve(**args)  # compiles, loads and caches the layer table
    torch.cuda.synchronize()
    hits, misses, _ = args["counters"].tolist()
    status = int(args["status"].max())
    nbytes = misses * ROW_BYTES
    call = _time_us(lambda: ops.resolve(**args), restore, iters)
    layers = {"gpu_layers": args["gpu_layers"], "host_layers": args["host_layers"]}
    copy = _time_us(lambda: ops.replay(miss_plan=args["miss_plan"], miss_count=args["miss_count"], **layers),
                    lambda: None, iters)
    return {
        "hits": hits,
        "misses": misses,
        "status": status,
        "resolve_and_copy": _summary(call, nbytes),
        "copy_only": _summary(copy, nbytes),
    }


def bulk_h2d(nbytes: int = 256 << 20, iters: int = 10) -> dict:
    src = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    times = _time_us(lambda: dst.copy_(src, non_blocking=True), lambda: None, iters)
    return {"bytes": nbytes, "median_gb_per_s": round(nbytes / statistics.median(times) / 1e3, 2)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="five cases instead of all")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel_bench: no CUDA device; this benchmark needs a GPU")
    from hisparse.kernels import ops

    bulk = bulk_h2d()
    host_pool = torch.zeros(HOST_BLOCKS * BLOCK_SIZE, ROW_BYTES, dtype=torch.uint8, pin_memory=True)
    results = []
    for seed, (hot_rows, batch, miss_rate) in enumerate(QUICK if args.quick else CASES):
        case = build(hot_rows, batch, miss_rate, host_pool, seed)
        row = {"hot_rows": hot_rows, "batch": batch, "miss_rate": miss_rate, **measure(ops, case, args.iters)}
        for part in ("resolve_and_copy", "copy_only"):
            row[part]["vs_bulk_h2d"] = round(row[part]["gb_per_s"] / bulk["median_gb_per_s"], 3)
        results.append(row)
        del case
    report = {
        "device": torch.cuda.get_device_name(),
        "shape": {"top_k": TOP_K, "row_bytes": ROW_BYTES, "block_size": BLOCK_SIZE, "seq_len": SEQ_LEN, "layers": 1},
        "bulk_h2d": bulk,
        "resolve": results,
        "bulk_h2d_after": bulk_h2d(),  # the link's rate again: a drift between the two shows a noisy run
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
