"""Issue 8's scenario 2 as numbers: vLLM 0.33.0 alone, with its native HiSparse, and with hisparse.

16 requests of 32,000 tokens (64 generated each), DeepSeek-V3.2 shapes, a KV pool that holds 4 of them fully
resident; the CPU harness of ``tests/vllm_harness.py`` checks every top-K row read on one layer of each of
vLLM's six resident groups. Prints one JSON line per mode: vLLM's running-requests gauge while requests wait
(mean) and at most, preemptions, rows checked and rows read from the host pool. ``hisparse-fifo`` is hisparse
with ``policy: fifo`` (vLLM's decisions, no heat): against ``hisparse`` (``coldest``), what heat changes.
``--selection locality``: the fake indexer selects from the per-page model of ``hisparse.tools.locality``
(sinks, a recent window, drifting topics with reuse, fitted to the published miss rates) instead of a fixed
40% of each request's pages, so that what heat ranks recurs as a real indexer's selections do.

    .venv/bin/python benches/vllm_pressure.py [--modes plain native hisparse hisparse-fifo]
                                              [--selection favourites|locality]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import vllm_harness as H  # noqa: E402

GROUP_LAYERS = [0, 12, 24, 36, 48, 60]


MODES = ("plain", "native", "hisparse", "hisparse-fifo")


def run(mode: str, selection: str = "favourites") -> dict:
    jobs = [H.Job(f"r{i}", H.prompt(i, 32000), 64) for i in range(16)]
    engine, _, policy = mode.partition("-")
    setup = H.build(mode=engine, gpu_gib=6.1, max_model_len=32768, host_pool_gib=24,
                    extra={"policy": policy} if policy else None)
    stats = H.run(setup, H.FakeWorker(setup, layers=GROUP_LAYERS, selection=selection), jobs)
    return {"mode": mode, "selection": selection,
            "running_while_waiting": round(statistics.mean(stats.pressure_samples), 2),
            "max_running": stats.max_running, "preemptions": stats.preemptions, "steps": stats.steps,
            "rows_checked": stats.rows_checked, "indexer_rows_checked": stats.indexer_rows_checked,
            "rows_from_host": stats.rows_from_host}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--selection", choices=H.SELECTIONS, default="favourites")
    args = ap.parse_args()
    for mode in args.modes:
        print(json.dumps(run(mode, args.selection)), flush=True)


if __name__ == "__main__":
    main()
