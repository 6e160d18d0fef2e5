#!/usr/bin/env bash
# Runs on a GPU machine with torch (CUDA) but no TVM compiler, in a checkout carrying
# .device-bundle and build/kernels (from tools/gpu-kit.sh): the GPU tests, the benchmarks
# (JSON), the serving example and the Relax Llama on CUDA. Everything lands in $OUT (default
# ./gpu-check-out): gpu-check.log and bench-<name>.json -- five files, under the device tool's
# limit of eight.
# A failing step is logged and the next one still runs; the exit status counts the failures.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
LOG="$OUT/gpu-check.log"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device-bundle/*.whl \
  && tar xzf .device-bundle/tvm-runtime.tgz -C /tmp/site || { echo "bundle install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD TVM_USE_RUNTIME_LIB=1 PYTHONUNBUFFERED=1 \
       KVTVM_KERNEL_PATH=$PWD/build/kernels KVTVM_CACHE_DIR=/tmp/kvtvm-no-cache
failed=0
step() {  # step NAME COMMAND...: run, log, count a failure
  echo "=== $1 ($(date -u +%H:%M:%S))" | tee -a "$LOG"
  shift
  "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { failed=$((failed + 1)); echo "=== FAILED (exit $rc)" | tee -a "$LOG"; }
}
step device nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv
step "GPU tests" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_decode_cuda_build.py \
     tests/test_prefill_cuda_build.py tests/test_copy_kernel.py tests/test_manager_cuda.py
for b in append copy decode prefill; do
  step "bench $b" python3 -m kvtvm bench "$b" --device cuda --json "$OUT/bench-$b.json"
done
step "bench host" python3 -m kvtvm bench host --device cuda --head-dim 32  # serve.py's kernels
step "serve --device cuda" python3 examples/serve.py --device cuda --kernels build/kernels
for m in build/kernels/relax_llama_*.so; do
  step "relax_llama --device cuda" python3 examples/relax_llama.py --load "$m" --device cuda
done
echo "=== $failed step(s) failed" | tee -a "$LOG"
exit "$failed"
