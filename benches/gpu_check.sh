#!/usr/bin/env bash
# The GPU check of a session lent a device (one run, under 8 minutes): installs the carried abi3 wheel, prints the
# kernels' register and shared-memory report, runs the GPU tests (every CPU-harness case kind on the device,
# bit-exact against the CPU reference; the public launchers; graph capture and replay) and the kernel benchmark,
# and leaves everything in $OUT (JSON + logs). Nothing is built on the device machine.
#
# Here, before the run:
#   echo /.whl/ >> .git/info/exclude
#   maturin build --release -o .whl            # hisparse-*-abi3-*.whl serves the device's Python 3.10+
# Then the device tool: run(command="bash benches/gpu_check.sh", carry=[".whl"], timeout_s=500)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HISPARSE_CACHE_DIR=/tmp/hisparse-cache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/hisparse-*.whl \
  || { echo "no hisparse wheel under .whl/: build it here first" >&2; exit 2; }
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 90 python3 benches/kernel_report.py > "$OUT/kernels.json"; echo "kernels: rc=$?"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py 2>&1 | tee "$OUT/pytest_gpu.log"
echo "pytest: rc=${PIPESTATUS[0]}"
timeout 150 python3 benches/kernel_bench.py 2>&1 | tee "$OUT/kernel_bench.json"
echo "bench: rc=${PIPESTATUS[0]}"
