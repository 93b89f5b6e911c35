#!/usr/bin/env bash
# The GPU check of a session lent a device (one run, well under 8 minutes): installs the carried abi3 wheel,
# prints the kernels' register report, runs the GPU tests (bit-exact against the CPU reference, graph
# capture) and the kernel benchmark, and leaves everything in $OUT (JSON + logs).
#
# Here, before the run (nothing is built on the device machine):
#   echo /.whl/ >> .git/info/exclude
#   maturin build --release -o .whl            # hisparse-*-abi3-*.whl serves the device's Python 3.12
# Then the device tool: run(command="bash benches/gpu_check.sh", carry=[".whl"], timeout_s=480)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HISPARSE_CACHE_DIR=/tmp/hisparse-cache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/hisparse-*.whl \
  || { echo "no hisparse wheel under .whl/: build it here first" >&2; exit 2; }
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 120 python3 -m hisparse.kernels.compiler > "$OUT/kernels.json"; echo "kernels: rc=$?"
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py 2>&1 | tee "$OUT/pytest_gpu.log"
echo "pytest: rc=${PIPESTATUS[0]}"
timeout 180 python3 benches/kernel_bench.py 2>&1 | tee "$OUT/kernel_bench.json"
echo "bench: rc=${PIPESTATUS[0]}"
