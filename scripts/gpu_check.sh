#!/usr/bin/env bash
# Everything about the CUDA kernels that needs a GPU, in one run (a few minutes; under 8 on an
# H100/H200): build custom_ops/gpu/kernel_api.cu with nvcc for this GPU, run every kernel check
# against the NumPy references (tests/gpu/check_kernels.py: fp32, bf16, fp16; the KV-cache kernels
# also over int8 and fp8 e4m3 caches), then measure decode attention's bandwidth against the copy
# bandwidth and the step-input preparation's time (tests/gpu/bench_kernels.py). Needs Python with
# NumPy and CuPy, nvcc and a GPU; not Paddle.
#
#   bash scripts/gpu_check.sh [OUT_DIR]     # default: $OUT (the device tool's folder) or gpu-check-out
#
# Writes OUT_DIR/checks.txt, OUT_DIR/bench.txt and OUT_DIR/bench.json; exits non-zero if a check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$out_dir"
export BLOCKSERVE_KERNEL_BUILD_DIR="${BLOCKSERVE_KERNEL_BUILD_DIR:-$out_dir/build}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  date -u
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
  command -v nvcc >/dev/null && nvcc --version | tail -2
  python -c 'import numpy, cupy; print("numpy", numpy.__version__, "cupy", cupy.__version__)'
} 2>&1 | tee "$out_dir/environment.txt"

timeout 420 python -m tests.gpu.check_kernels 2>&1 | tee "$out_dir/checks.txt"
checks=${PIPESTATUS[0]}
timeout 150 python -m tests.gpu.bench_kernels --json "$out_dir/bench.json" 2>&1 | tee "$out_dir/bench.txt"
bench=${PIPESTATUS[0]}
echo "checks exit ${checks}, benchmark exit ${bench}; results in ${out_dir}"
[ "$checks" -eq 0 ] && [ "$bench" -eq 0 ]
