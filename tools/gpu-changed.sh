#!/usr/bin/env bash
# The GPU checks of the latest session's changes in one call (carry .device-bundle, build/kernels
# from tools/gpu-kit.sh and build/probe-layout from `python tools/gpu_decode_layout_probe.py
# build build/probe-layout`; move build/**/*.ptxas.txt out first if the carry is over 64 MiB).
# The fifteenth session ran it (2026-11-27, H100, call 2 in docs/PERF.md: 0 failed); a later
# session reruns it as the regression set of these changes:
# - the 8-bit decode's split count (`CUDA_QUANT_SPLIT_TOKENS` where the grid is large): the
#   layout probe times 1-8 splits at the batch shapes it changes, and bench decode the ratios
#   the ops give, large batches included;
# - K-only and V-only decode on the tensor cores by default at head_dim 128, GQA <= 4 (bench
#   decode int8/none and none/float8_e4m3fn; the mixed-decode GPU tests);
# - the quantizing append's subnormal-scale rule (a row whose scale would be below 2**-126 is
#   stored with scale 0 and zero values) and the non-finite decode's V-only case (its append is
#   in the kit now): among the GPU tests; compute-sanitizer over the ops' GPU tests.
# Each step has its own time limit so that one stuck step leaves the rest their time. Logs and
# JSON land in $OUT (8 files at most).
set -uo pipefail
source "$(dirname "$0")/gpu-env.sh"
step device nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv
step "GPU tests" timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/compiler \
     tests/kernels tests/manager tests/ops tests/quant
step "decode splits probe" timeout 150 python3 tools/gpu_decode_layout_probe.py run \
     build/probe-layout --repeat 20 --shapes 32x4096 64x4096 128x4096 256x1024 256x4096 \
     --splits 1 2 3 4 8 --json "$OUT/decode-splits.json"
step "bench decode" timeout 120 python3 -m kvtvm bench decode --device cuda --skip tvm \
     --cache-dtype float16 int8 float8_e4m3fn int8/none none/float8_e4m3fn \
     --cases 16x4096 32x4096 64x4096 128x4096 256x1024 1x32768 1x4096 8x4096 \
     --json "$OUT/bench-decode.json"
LOG=$LOG MEMCHECK_STEPS=ops timeout 120 bash tools/gpu-memcheck.sh || failed=$((failed + 1))
echo "=== $failed step(s) failed" | tee -a "$LOG"
exit "$failed"
