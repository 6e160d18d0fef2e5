#!/usr/bin/env bash
# The GPU checks owed by the latest sessions in one call (carry .device-bundle, build/kernels
# from tools/gpu-kit.sh, build/probe-mma from `python tools/gpu_decode_mma_probe.py build
# build/probe-mma` and build/probe-layout from `python tools/gpu_decode_layout_probe.py build
# build/probe-layout`; move build/**/*.ptxas.txt out first if the carry is over 64 MiB):
# - the tensor-core 8-bit decode: numerics of every probe case, the K-only / V-only cases
#   (knobs `one_sided_knobs`, fourteenth session: never run on a GPU yet) among them, and its
#   speed against the CUDA-core kernel and the float16 cache, K-only and V-only included;
# - where the 8-bit decode's bandwidth goes at 64 x 4K and 256 x 1K (H100: 1.46-1.49x the
#   float16 cache, issue 16 asks 1.5x): nhd against hnd, and the split count;
# - every GPU test under tests/: the fourteenth session changed the CUDA quantizing append (rows
#   whose amax is below 2**-100 are prescaled; tests/quant/test_quant_cuda.py's append-bytes
#   test gained such a row: never run on a GPU yet), not the shipped decode (the both-8-bit
#   tensor-core source is byte-identical); the decode benchmark; compute-sanitizer over the
#   ops' GPU tests;
# - the fifteenth session's non-finite fix: a query whose every score is -inf (a full-precision
#   key holding -inf) gets NaN out and lse from every CUDA decode (any split count: the merge
#   tells an all -inf split from an empty one) and prefill kernel
#   (tests/quant/test_quant_nonfinite_cuda.py, among the GPU tests).
# Each step has its own time limit so that one stuck step leaves the rest their time. Logs and
# JSON land in $OUT (8 files at most).
set -uo pipefail
source "$(dirname "$0")/gpu-env.sh"
step device nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv
step "decode mma probe" timeout 120 python3 tools/gpu_decode_mma_probe.py run build/probe-mma \
     --json "$OUT/decode-mma.json"
step "decode layout probe" timeout 150 python3 tools/gpu_decode_layout_probe.py run \
     build/probe-layout --repeat 20 --json "$OUT/decode-layout.json"
step "GPU tests" timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/compiler \
     tests/kernels tests/manager tests/ops tests/quant
step "bench decode" timeout 50 python3 -m kvtvm bench decode --device cuda --skip tvm \
     --cache-dtype float16 int8 float8_e4m3fn int8/none \
     --cases 16x4096 64x4096 1x32768 1x4096 --json "$OUT/bench-decode.json"
LOG=$LOG MEMCHECK_STEPS=ops timeout 90 bash tools/gpu-memcheck.sh || failed=$((failed + 1))
echo "=== $failed step(s) failed" | tee -a "$LOG"
exit "$failed"
