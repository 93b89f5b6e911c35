"""Issue 8's scenarios as a table: each runs on vLLM 0.33.0 alone and with hisparse (the same traces as
``tests/test_vllm_integration.py``; scenario 2 is ``benches/vllm_pressure.py``). One JSON line per scenario
and mode: running requests (max, and mean while some request waits), preemptions, prefix-hit tokens, and the
rows checked (sparse-MLA top-K rows, indexer rows) and read from the host pool. Every row read was checked
against what was written, as in the tests.

    .venv/bin/python benches/vllm_scenarios.py
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import vllm_harness as H  # noqa: E402

GROUP_LAYERS = [0, 12, 24, 36, 48, 60]


def scenarios():
    shared = H.prompt(1000, 4096)
    prefix = [H.Job(f"a{i}", H.prompt(i, 6000, shared), 24) for i in range(2)]
    prefix += [H.Job(f"b{i}", H.prompt(10 + i, 6000, shared), 24, arrival=8) for i in range(2)]
    prefix += [H.Job(f"c{i}", H.prompt(20 + i, 7000), 8, arrival=60) for i in range(3)]
    prefix += [H.Job(f"d{i}", H.prompt(30 + i, 5000, shared), 24, arrival=140) for i in range(2)]
    three = [H.Job(f"r{i}", H.prompt(i, 6000), 16) for i in range(3)]
    return {
        "1-sync-61-layers": (dict(gpu_gib=0.9, max_model_len=8192, host_pool_gib=20), three, None, 0),
        "1-async-61-layers": (dict(gpu_gib=0.9, max_model_len=8192, host_pool_gib=20, async_scheduling=True),
                              three, None, 0),
        "3-prefix-caching": (dict(gpu_gib=1.0, max_model_len=8192, host_pool_gib=20), prefix, GROUP_LAYERS, 0),
        "4-preemption-recycling": (dict(gpu_gib=0.8, max_model_len=8192, host_pool_gib=40),
                                   [H.Job(f"r{i}", H.prompt(i, 5000 + 97 * i), 24, arrival=3 * i) for i in range(16)],
                                   GROUP_LAYERS, 0),
        "5-tp2-async-pickled": (dict(gpu_gib=1.0, max_model_len=8192, host_pool_gib=20, async_scheduling=True),
                                [H.Job(f"r{i}", H.prompt(i, 6000), 12) for i in range(3)], GROUP_LAYERS, 0),
        "6-mtp-3": (dict(gpu_gib=2.0, max_model_len=16384, host_pool_gib=40, num_spec_tokens=3),
                    [H.Job(f"r{i}", H.prompt(i, 12000), 40) for i in range(3)], GROUP_LAYERS, 3),
    }


def main() -> None:
    for name, (kwargs, jobs, layers, spec) in scenarios().items():
        for mode in ("plain", "hisparse"):
            setup = H.build(mode=mode, **kwargs)
            tp = 2 if name.startswith("5") else 1
            stats = H.run(setup, H.FakeWorker(setup, layers=layers, tp=tp), jobs, num_spec_tokens=spec)
            waiting = stats.pressure_samples
            print(json.dumps({
                "scenario": name, "mode": mode, "max_running": stats.max_running,
                "running_while_waiting": round(statistics.mean(waiting), 2) if waiting else None,
                "preemptions": stats.preemptions, "prefix_hit_tokens": stats.prefix_hit_tokens,
                "rows_checked": stats.rows_checked, "indexer_rows_checked": stats.indexer_rows_checked,
                "rows_from_host": stats.rows_from_host, "steps": stats.steps}), flush=True)


if __name__ == "__main__":
    main()
