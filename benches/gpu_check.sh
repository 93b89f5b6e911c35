#!/usr/bin/env bash
# The GPU check of a session lent a device (one run, under 7 minutes): installs the carried abi3 wheel, checks that
# it holds this tree's kernels and Python package, prints the kernels' register and shared-memory report, runs the
# GPU tests (every CPU-harness case kind on the device, bit-exact against the CPU reference; the public launchers;
# graph capture and replay; the page mover's DMA streams; the worker hooks with no host-device synchronization,
# reading what the CPU path reads) and the kernel benchmark, and leaves everything in $OUT (JSON + logs). Nothing is
# built on the device machine. Exits non-zero when any step fails, when the wheel is not this tree, or when a GPU
# test was skipped (a skip there means the device path did not run).
#
# Here, before the run (the wheel must be built from the tree as it is now: the check refuses a stale one):
#   echo /.whl/ >> .git/info/exclude
#   rm -rf .whl && maturin build --release -o .whl   # hisparse-*-abi3-*.whl serves the device's Python 3.10+
# Then the device tool: run(command="bash benches/gpu_check.sh", carry=[".whl"], timeout_s=420)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HISPARSE_CACHE_DIR=/tmp/hisparse-cache
wheels=(.whl/hisparse-*.whl)
if [ ${#wheels[@]} -ne 1 ] || [ ! -f "${wheels[0]}" ]; then
  echo "need exactly one hisparse wheel under .whl/ (found ${#wheels[@]}): build it here first" >&2
  exit 2
fi
SITE=$(mktemp -d)  # fresh: pip --target does not replace a package a warm machine kept from an earlier run
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${wheels[0]}" \
  || python3 -m zipfile -e "${wheels[0]}" "$SITE" || exit 2  # unpacking is the same install where pip rejects the tag
export PYTHONPATH=$SITE
failed=()

# The wheel's embedded kernels (what the device compiles: the installed package has no cuda/ beside it) and its
# Python files must be this tree's, or every result below would be about other code.
python3 - <<'EOF' 2>&1 | tee "$OUT/wheel_check.txt"
import pathlib
import sys

import hisparse
from hisparse import _core

embedded = dict(_core.kernel_sources())
tree = {f.name: f.read_text() for f in sorted(pathlib.Path("cuda").glob("*.cu*"))}
differ = sorted(set(embedded) ^ set(tree)) + sorted(n for n in embedded if n in tree and embedded[n] != tree[n])
site = pathlib.Path(hisparse.__file__).parent
for f in sorted(pathlib.Path("python/hisparse").rglob("*.py")):
    installed = site / f.relative_to("python/hisparse")
    if not installed.is_file() or installed.read_bytes() != f.read_bytes():
        differ.append(str(f))
if differ:
    sys.exit(f"the carried wheel is not this tree (differs: {differ}): rebuild it with maturin build")
print(f"wheel matches the tree: {len(tree)} kernel files and the Python package")
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "wheel check failed" >&2; exit 3; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 90 python3 benches/kernel_report.py > "$OUT/kernels.json"
rc=$?; echo "kernels: rc=$rc"; [ $rc -eq 0 ] || failed+=(kernel_report)

per_test=$(python3 -c "import pytest_timeout" 2>/dev/null && echo --timeout=60)  # one hung test must not eat the lease
# Workers in their own processes: a kernel fault ends its worker (tests/conftest.py), not the tests after it.
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
timeout 200 python3 -m pytest -q -m gpu -rs -p no:cacheprovider $per_test $workers --junitxml="$OUT/pytest_gpu.xml" \
  tests/test_kernels_gpu.py tests/test_kernels_transfer.py tests/test_hooks_gpu.py tests/test_vllm_heat_gpu.py \
  tests/test_bad_input.py 2>&1 | tee "$OUT/pytest_gpu.log"
rc=${PIPESTATUS[0]}; echo "pytest: rc=$rc"; [ $rc -eq 0 ] || failed+=(pytest)
python3 - "$OUT/pytest_gpu.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET

try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as e:
    sys.exit(f"no pytest report: {e}")
suites = [root] if root.tag == "testsuite" else list(root)
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "skipped", "failures", "errors")}
print(f"GPU tests: {n}")
if n["skipped"] or not n["tests"]:
    sys.exit("GPU tests were skipped (or none ran): the device path was not tested")
EOF
[ $? -eq 0 ] || failed+=(gpu_tests_skipped)

if [ "${GPU_CHECK_BENCH:-1}" = 1 ]; then  # GPU_CHECK_BENCH=0: the tests alone, while fixing what they find
  timeout 110 python3 benches/kernel_bench.py --budget 60 > "$OUT/kernel_bench.json" 2> "$OUT/kernel_bench.log"
  rc=$?; echo "bench: rc=$rc"; [ $rc -eq 0 ] || failed+=(kernel_bench)
  python3 -c "import json, sys; print(json.dumps(json.load(open(sys.argv[1]))['targets'], indent=1))" \
    "$OUT/kernel_bench.json" || failed+=(kernel_bench_report)
fi

if [ ${#failed[@]} -ne 0 ]; then
  echo "gpu_check FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "gpu_check passed"
