#!/usr/bin/env bash
# Runs on a GPU machine (as tools/gpu-check.sh: carrying .device-bundle and build/kernels from
# tools/gpu-kit.sh): the ops' GPU tests, the in-kernel bounds tests and the serving example under
# `compute-sanitizer --tool memcheck`, which must report 0 errors. Logs land in $OUT (default
# ./gpu-check-out): gpu-memcheck.log (the steps) and memcheck-<step>.txt (the sanitizer's own
# reports). The exit status counts the failed steps (a memcheck error fails its step).
# Only kvtvm's kernels are instrumented (--kernel-name kns=kvtvm): torch's, which the
# transformers token check runs, would make the serving step take many minutes. torch's caching
# allocator is off, so an access past a tensor is past its allocation.
set -uo pipefail
LOG=${LOG:-${OUT:-$PWD/gpu-check-out}/gpu-memcheck.log}
source "$(dirname "$0")/gpu-env.sh"
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
SAN=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
STEPS=" ${MEMCHECK_STEPS:-bounds serve ops} "  # which of the three steps below to run
memcheck() {  # memcheck NAME COMMAND...: the command under memcheck, its report in $OUT
  local name=$1
  shift
  [[ $STEPS == *" $name "* ]] || return 0
  step "memcheck $name" "$SAN" --tool memcheck --kernel-name kns=kvtvm --error-exitcode 1 \
       --leak-check no \
       --print-limit 100 --log-file "$OUT/memcheck-$name.txt" "$@"
  grep -h "ERROR SUMMARY" "$OUT/memcheck-$name.txt" | tee -a "$LOG"
}
step device nvidia-smi --query-gpu=name,driver_version --format=csv
memcheck bounds python3 -m pytest -q -p no:cacheprovider tests/ops/test_bounds_cuda.py
memcheck serve python3 examples/serve.py --model toy --device cuda --dtype float32 \
     --kernels build/kernels
# the ops on the GPU: numerics, bad input, the kernels' own bounds checks (unchecked mode)
memcheck ops python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels \
     tests/ops/test_copy_kernel.py tests/manager/test_manager_cuda.py \
     tests/manager/test_manager_linear_cuda.py tests/quant/test_quant_cuda.py \
     tests/quant/test_quant_decode_mixed_cuda.py tests/quant/test_quant_prefill_cuda.py \
     tests/ops/test_decode_cuda_shapes.py
echo "=== $failed step(s) failed" | tee -a "$LOG"
exit "$failed"
