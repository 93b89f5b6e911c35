"""Where the vLLM plugin pays off and where it costs: vLLM 0.33.0's real scheduler on CPU (tests/vllm_harness.py),
vLLM alone (``plain``), vLLM's native HiSparse and vLLM + hisparse (``coldest``) on the default async scheduler,
same KV memory. One JSON line per workload:

- ``pressure_8K`` / ``pressure_16K``: 12 requests of 8,448 / 16,384 prompt tokens (32 generated) in a pool that
  holds about 4 of them fully resident (``benches/vllm_pressure.py`` runs the 32,000-token case). Reported:
  requests running while some wait (mean, max) and preemptions.
- ``long_outputs``: 10 requests of 2-2.6K prompt tokens generating 1,500 tokens each (a reasoning-style load).
- ``short_requests``: 300 requests of 100-400 prompt tokens generating 64 each, ``max_num_seqs`` 256.
- ``region_costlier``: 4 requests of 9,000 prompt tokens generating 400 each under MTP 3 (1,024-token chunks,
  the offloading connector beside), in a pool that holds two of them fully resident. Their hot region (960
  blocks with MTP 3) costs more than all their pages resident (147 pages of 7 blocks): vLLM's HiSparse moves
  each to one when its admission window fills, hisparse keeps them resident.
  Reported for these three: steps to serve everything, mean running, preemptions.

    .venv/bin/python benches/vllm_capacity.py [--workloads pressure_8K ...] [--modes plain native hisparse]
        [--device-buffer-size ROWS] [--check-bytes]

``--device-buffer-size``: vLLM's hot-region rows per request (``--attention-config '{"hisparse_config":
{"device_buffer_size": ROWS}}'``; vLLM's default is two top-Ks, 4,096 rows). ``--check-bytes``: the fake forward
writes and reads every row (layers 0 and 60), checking each read, and the line reports the rows read and how
many came from the host pool (slower).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import vllm_harness as H  # noqa: E402


def _pressure(length: int, gpu_gib: float) -> dict:
    jobs = [H.Job(f"p{i}", H.prompt(i, length), 32) for i in range(12)]
    return {"setup": dict(gpu_gib=gpu_gib, max_model_len=length + 768, host_pool_gib=48), "jobs": jobs}


WORKLOADS = {
    "pressure_8K": lambda: _pressure(8448, 1.7),
    "pressure_16K": lambda: _pressure(16384, 3.2),
    "long_outputs": lambda: {"setup": dict(gpu_gib=0.8, max_model_len=8192, host_pool_gib=24),
                             "jobs": [H.Job(f"g{i}", H.prompt(i, 2048 + 64 * i), 1500, arrival=i)
                                      for i in range(10)]},
    "short_requests": lambda: {"setup": dict(gpu_gib=0.9, max_model_len=8192, host_pool_gib=24, max_num_seqs=256),
                               "jobs": [H.Job(f"t{i}", H.prompt(5000 + i, 100 + (i % 7) * 50), 64)
                                        for i in range(300)]},
    "region_costlier": lambda: {"setup": dict(gpu_gib=1.2, max_model_len=16384, num_spec_tokens=3,
                                              max_num_batched_tokens=1024, host_pool_gib=40, offload_gib=0.25,
                                              max_num_seqs=64),
                                "jobs": [H.Job(f"r{i}", H.prompt(500 + i, 9000), 400, arrival=3 * i)
                                         for i in range(4)]},
}


MODES = ("plain", "native", "hisparse")


def measure(workload: dict, mode: str, device_buffer_size: int | None = None, check_bytes: bool = False) -> dict:
    setup = H.build(mode=mode, async_scheduling=True, device_buffer_size=device_buffer_size, **workload["setup"])
    worker = (H.FakeWorker(setup, layers=[0, 60], completion_lag=1) if check_bytes
              else H.FakeWorker(setup, layers=[0], reads=False, data=False))
    stats = H.run(setup, worker, workload["jobs"], num_spec_tokens=workload["setup"].get("num_spec_tokens", 0))
    mean = sum(stats.running_samples) / len(stats.running_samples)
    under_pressure = sum(stats.pressure_samples) / max(1, len(stats.pressure_samples))
    out = {"steps": stats.steps, "mean_running": round(mean, 2), "mean_running_while_waiting":
           round(under_pressure, 2), "max_running": stats.max_running, "preemptions": stats.preemptions}
    if check_bytes:
        out |= {"rows_checked": stats.rows_checked, "rows_from_host": stats.rows_from_host}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--device-buffer-size", type=int, default=None)
    ap.add_argument("--check-bytes", action="store_true")
    args = ap.parse_args()
    for name in args.workloads:
        workload = WORKLOADS[name]()
        results = {mode: measure(workload, mode, args.device_buffer_size, args.check_bytes) for mode in args.modes}
        print(json.dumps({"workload": name, "device_buffer_size": args.device_buffer_size, **results}), flush=True)


if __name__ == "__main__":
    main()
