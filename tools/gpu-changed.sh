#!/usr/bin/env bash
# The GPU checks of the latest sessions' changes in one call (carry .device-bundle and
# build/kernels from tools/gpu-kit.sh; move build/**/*.ptxas.txt out first if the carry is over
# 64 MiB). The twenty-first session ran it (docs/PERF.md, 2026-11-28, H200); a later session
# reruns it as the regression set of these changes:
# - the tensor-core 8-bit decode at GQA 9-16 in head parts (two CTAs a KV head): numerics in the
#   GPU tests (tests/ops/test_decode_cuda_shapes.py: GQA 16, 12, 9), memcheck, and its speed
#   against the float16 cache at GQA 16 (the CUDA-core kernel ran 0.59-0.76x there);
# - heads of 48, 80 and 112 on the tensor cores (V's last 32-column group zero-padded): the
#   GPU tests, memcheck, and the speed against the float16 cache at heads of 80 and 48, GQA 8;
# - the CUDA-core 8-bit decode's head parts (`head_split`), bank padding and the cap of 64 row
#   groups x head parts along threadIdx.z (d16; float32 queries): the GPU tests, memcheck;
# - the 8-bit decode at the Llama-3-8B layer against the float16 cache (issue 16's target), as
#   a check that GQA <= 8 lost nothing to the head parts' indexing;
# - NOT YET RUN (twenty-second session, no GPU): GQA past 16 on the tensor cores in 3-4 head
#   parts (tests/ops/test_decode_cuda_shapes.py: GQA 32 and 20) and its speed at GQA 32.
# Each step has its own time limit so that one stuck step leaves the rest their time. Logs land
# in $OUT (8 files at most).
set -uo pipefail
source "$(dirname "$0")/gpu-env.sh"
step device nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv
step "GPU tests" timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/compiler \
     tests/kernels tests/manager tests/ops tests/quant
LOG=$LOG MEMCHECK_STEPS=ops timeout 100 bash tools/gpu-memcheck.sh || failed=$((failed + 1))
step "bench decode" timeout 45 python3 -m kvtvm bench decode --device cuda --skip tvm gather \
     --cache-dtype float16 int8 float8_e4m3fn --cases 16x4096 64x4096 256x1024 1x4096
# 8-bit decode off the Llama grid against the float16 cache at the same heads (their kernels:
# the "speed off the Llama grid" lines of tools/gpu-kit.sh; the float16 CUDA decode takes no
# head of 112): GQA 16, heads of 80 and 48 (zero-padded V groups), K-only and V-only
# at GQA 8 and 16 on the tensor cores (the CUDA cores ran K-only at 0.82-0.97x the float16
# cache)
for shape in "64 16 int8 float8_e4m3fn" "80 8 float8_e4m3fn" "48 8 int8" \
             "128 8 int8/none none/float8_e4m3fn" "128 16 int8/none none/float8_e4m3fn" \
             "128 32 int8 float8_e4m3fn"; do
  set -- $shape
  step "bench decode d$1 GQA $2 ${*:3}" timeout 40 python3 -m kvtvm bench decode \
       --device cuda --skip tvm gather dense --n-kv-heads 2 --head-dim "$1" --group-size "$2" \
       --cache-dtype float16 "${@:3}" --cases 1x4096 16x4096 64x4096 128x4096 1x32768
done
# float32 queries (always the CUDA-core kernel) against the float32 cache
step "bench decode float32 d128 GQA 4 int8" timeout 40 python3 -m kvtvm bench decode \
     --device cuda --skip tvm gather dense --dtype float32 --n-kv-heads 2 --head-dim 128 \
     --group-size 4 --cache-dtype float32 int8 --cases 1x4096 16x4096 64x4096 1x32768
echo "=== $failed step(s) failed" | tee -a "$LOG"
exit "$failed"
