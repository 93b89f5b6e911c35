"""What every kernel costs on each architecture CI compiles for, without a GPU: registers per thread, spills,
stack and static shared memory (NVRTC's ptxas report), and resolve's shared memory per architecture and
configuration (hisparse.kernels.launch). Prints one JSON object; ``--markdown`` prints tables instead.

    PYTHONPATH=python python benches/kernel_report.py [--markdown]
"""

from __future__ import annotations

import argparse
import json

from hisparse.kernels import COMPILED_ARCHS, launch, shared_memory_table
from hisparse.kernels.compiler import compile_report


def markdown(kernels: list[dict], shared: list[dict]) -> str:
    lines = ["| kernel | " + " | ".join(COMPILED_ARCHS) + " |", "|---|" + "---|" * len(COMPILED_ARCHS)]
    for name in sorted({k["kernel"] for k in kernels}):
        cells = {k["arch"]: k for k in kernels if k["kernel"] == name}
        lines.append(f"| {name} | " + " | ".join(
            f"{cells[a]['registers']} regs, {cells[a]['spill_stores'] + cells[a]['spill_loads']} B spilled"
            for a in COMPILED_ARCHS) + " |")
    lines += ["", "resolve's shared memory in KiB (static + dynamic), top_k 2048, 128 requests of `rows/req` batch "
              "rows each; * = the table is smaller than the selection asks (resolved bucket by bucket)",
              "",
              "| H | rows/req | " + " | ".join(f"{a} (limit {launch.smem_limit(a) // 1024})" for a in COMPILED_ARCHS)
              + " |", "|---|---|" + "---|" * len(COMPILED_ARCHS)]
    for h in launch.TABLE_HOT_ROWS:
        for n in launch.TABLE_ROWS_PER_REQUEST:
            cells = {r["arch"]: r for r in shared if (r["hot_rows"], r["rows_per_request"], r["batch"]) == (h, n, 128)}
            lines.append(f"| {h} | {n} | " + " | ".join(
                f"{cells[a]['total_bytes'] / 1024:.1f}{'*' if cells[a]['clamped'] else ''}" for a in COMPILED_ARCHS)
                + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    kernels, shared = compile_report(COMPILED_ARCHS), shared_memory_table(COMPILED_ARCHS)
    if args.markdown:
        print(markdown(kernels, shared))
    else:
        print(json.dumps({"kernels": kernels, "resolve_shared_memory": shared}))


if __name__ == "__main__":
    main()
