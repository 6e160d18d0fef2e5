#!/usr/bin/env bash
# Issue 14's GPU checks in one short call (carry .device-bundle, build/kernels from
# tools/gpu-kit.sh and build/probe from `python tools/gpu_copy_check_probe.py build build/probe`):
# every GPU test of the ops, kernels, compiler, managers and quantized caches; what the copy
# kernel's bounds check costs per vectors_per_thread; the copy benchmark; then
# tools/gpu-memcheck.sh (compute-sanitizer). Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu-env.sh"
step device nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv
step "GPU tests" timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=8 \
     tests/ops tests/kernels tests/compiler tests/manager tests/quant
step "copy check probe" timeout 45 python3 tools/gpu_copy_check_probe.py run build/probe
step "bench copy" timeout 45 python3 -m kvtvm bench copy --device cuda --json "$OUT/bench-copy.json"
LOG=$OUT/gpu-memcheck.log timeout 180 bash tools/gpu-memcheck.sh || failed=$((failed + 1))
echo "=== $failed step(s) failed" | tee -a "$LOG"
exit "$failed"
