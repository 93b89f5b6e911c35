"""Cost of one scheduler step of the residency core, called from Python, under pressure.

For each configuration (running requests x context tokens; block size 64, top_k 2048, hot rows 4096) the
GPU pool holds about 60% of all pages, so requests run in mixed residency and every step releases and
materializes pages. A measured step is ``plan_step`` for every request decoding one token plus
``complete`` of the copies it planned. Prints one JSON line: p50/p90 microseconds per configuration.

    python benches/core_step.py [--steps 400] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from hisparse import ResidencyManager

BLOCK = 64
TOP_K = 2048


def setup(requests: int, context: int) -> ResidencyManager:
    pages = context // BLOCK
    headroom = 8192  # decode room per request, in tokens
    m = ResidencyManager(
        num_gpu_blocks=int(0.6 * requests * pages),
        num_host_blocks=requests * (pages + headroom // BLOCK),
        block_size=BLOCK,
        max_model_len=context + headroom,
        max_running=requests,
        top_k=TOP_K,
        materialize_budget=4096,
        page_bytes=BLOCK * 656 * 78,
    )
    chunk = 32768
    for rid in range(requests):
        m.admit(rid, context, max_len=context + headroom)
        left = context
        while left:
            plan = m.plan_step([(rid, min(chunk, left))])
            if plan.ok:
                left -= min(chunk, left)
            else:
                plan = m.plan_step([])  # copy what is written, so it can be released
                if not plan.ok or not plan.transfer_ids:
                    raise RuntimeError(f"setup stuck: {m.capacity_log()}")
            m.complete(plan.transfer_ids)
    m.complete(m.plan_step([]).transfer_ids)
    return m


def measure(requests: int, context: int, steps: int) -> dict:
    m = setup(requests, context)
    scheduled = [(rid, 1) for rid in range(requests)]
    times, released, copied = [], 0, 0
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = m.plan_step(scheduled)
        ids = plan.transfer_ids
        m.complete(ids)
        times.append((time.perf_counter() - t0) * 1e6)
        assert plan.ok, m.capacity_log()
        released += plan.released_pages
        copied += len(ids)
    m.check_invariants()
    s = m.stats()
    times.sort()
    return {
        "p50": statistics.median(times),
        "p90": times[int(0.9 * (len(times) - 1))],
        "mixed_or_none": s["mixed"] + s["none"],
        "released_per_step": released / steps,
        "copied_per_step": copied / steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = ap.parse_args()
    configs = {"64x128k": (64, 131072), "64x1m": (64, 1048576), "256x128k": (256, 131072)}
    if args.quick:
        configs = {"8x16k": (8, 16384)}
    out: dict[str, float] = {}
    for name, (requests, context) in configs.items():
        r = measure(requests, context, args.steps)
        out[f"p50_us_{name}"] = round(r["p50"], 1)
        out[f"p90_us_{name}"] = round(r["p90"], 1)
        out[f"mixed_{name}"] = r["mixed_or_none"]
        out[f"released_per_step_{name}"] = round(r["released_per_step"], 2)
        out[f"copied_per_step_{name}"] = round(r["copied_per_step"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
