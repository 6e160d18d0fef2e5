#!/usr/bin/env bash
# The GPU checks of the latest sessions' changes in one call (carry .device-bundle and
# build/kernels from tools/gpu-kit.sh; move build/**/*.ptxas.txt out first if the carry is over
# 64 MiB). The twenty-first session ran it (docs/PERF.md); a later session reruns it as the
# regression set of these changes (sessions 16-20, built with nvcc but never run before):
# - the CUDA-core 8-bit decode's head parts (`head_split`), its bank padding of staged rows and
#   the cap of 64 row groups x head parts along threadIdx.z (d16; d32 under float32 queries):
#   numerics in the GPU tests (tests/ops/test_decode_cuda_shapes.py's 8-bit heads of 48, 80,
#   96, 112 and 16, tests/quant/test_quant_decode_mixed_cuda.py), memcheck over them, and the
#   speed of the CUDA-core kernels against the float16 cache at the same heads (bench decode);
# - the ops' refusals of misaligned q / out and aliasing copies, the collections' and engine's
#   locks: the GPU tests and the serving example;
# - the 8-bit decode at the Llama-3-8B layer against the float16 cache (issue 16's target).
# Each step has its own time limit so that one stuck step leaves the rest their time. Logs and
# JSON land in $OUT (8 files at most).
set -uo pipefail
source "$(dirname "$0")/gpu-env.sh"
step device nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv
step "GPU tests" timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/compiler \
     tests/kernels tests/manager tests/ops tests/quant
step "bench decode" timeout 120 python3 -m kvtvm bench decode --device cuda --skip tvm gather \
     --cache-dtype float16 int8 float8_e4m3fn int8/none none/float8_e4m3fn \
     --cases 16x4096 32x4096 64x4096 128x4096 256x4096 256x1024 1x32768 1x4096 8x4096 \
     --json "$OUT/bench-decode.json"
# the same kernels over hnd pages (a head's rows of a page contiguous): the 8-bit rows' sectors
step "bench decode hnd" timeout 120 python3 -m kvtvm bench decode --device cuda --skip tvm \
     gather --layout hnd --cache-dtype float16 int8 float8_e4m3fn \
     --cases 16x4096 32x4096 64x4096 128x4096 256x4096 256x1024 1x32768 1x4096 8x4096 \
     --json "$OUT/bench-decode-hnd.json"
LOG=$LOG MEMCHECK_STEPS=ops timeout 200 bash tools/gpu-memcheck.sh || failed=$((failed + 1))
# the CUDA-core 8-bit decode (head parts at GQA 8 for heads of 80 and 48; GQA 16) against the
# float16 cache at the same heads (their kernels: the "CUDA-core speed" lines of
# tools/gpu-kit.sh; the float16 CUDA decode takes no head of 112)
for shape in "80 8 float8_e4m3fn" "48 8 int8" "64 16 int8"; do
  set -- $shape
  step "bench decode d$1 GQA $2 $3" timeout 60 python3 -m kvtvm bench decode --device cuda \
       --skip tvm gather dense --n-kv-heads 2 --head-dim "$1" --group-size "$2" \
       --cache-dtype float16 "$3" --cases 1x4096 16x4096 64x4096 128x4096 1x32768
done
# host time of a step through the ops and through a step plan (rebind's checks) on CUDA
step "bench host" timeout 90 python3 -m kvtvm bench host --device cuda --head-dim 32
step "serve toy --device cuda bf16" timeout 120 python3 examples/serve.py --model toy \
     --cache all --device cuda --dtype bfloat16 --kernels build/kernels
echo "=== $failed step(s) failed" | tee -a "$LOG"
exit "$failed"
