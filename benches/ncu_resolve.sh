#!/usr/bin/env bash
# Nsight Compute on one resolve (benches/resolve_once.py; arguments pass through), on a machine with a GPU and
# ncu: the kernel's duration, instructions and where its warps wait, then the SASS loops that run the most
# warp instructions. Leaves the report and its CSV pages in $OUT (default ./ncu_out).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/ncu_out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-python}:benches
ncu -k regex:hisparse_resolve --launch-skip 1 -c 1 --set full -f -o "$OUT/resolve" python3 benches/resolve_once.py "$@"
ncu -i "$OUT/resolve.ncu-rep" --page details --csv > "$OUT/details.csv"
ncu -i "$OUT/resolve.ncu-rep" --page source --csv --print-source sass > "$OUT/sass.csv"
python3 - "$OUT" <<'PY'
import csv
import sys

out = sys.argv[1]
wanted = ("Duration", "SM Frequency", "Issued Instructions", "Executed Ipc Active", "Achieved Occupancy",
          "No Eligible", "Warp Cycles Per Issued Instruction", "Memory Throughput", "Registers Per Thread")
rows = list(csv.DictReader(open(f"{out}/details.csv")))
for r in rows:
    if r.get("Metric Name") in wanted:
        print(f"{r['Metric Name']}: {r['Metric Value']} {r['Metric Unit']}")
lines = list(csv.reader(open(f"{out}/sass.csv")))
head = lines[1]
sass = [dict(zip(head, r)) for r in lines[2:] if len(r) == len(head)]
executed = [float(s["Instructions Executed"].replace(",", "") or 0) for s in sass]
blocks, start = [], 0  # straight runs of instructions executed equally often
for i in range(1, len(sass) + 1):
    if i == len(sass) or executed[i] != executed[start]:
        blocks.append((executed[start] * (i - start), start, i - start))
        start = i
total = sum(executed)
print(f"warp instructions executed: {total:.0f}; the runs with the largest shares:")
for work, first, n in sorted(blocks, reverse=True)[:12]:
    print(f"  {100 * work / total:4.1f}%  {n:3d} instructions x {executed[first]:.0f}  from "
          f"{sass[first]['Address']}: {sass[first]['Source'].strip()}")
PY
