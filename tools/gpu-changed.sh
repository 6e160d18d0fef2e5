#!/usr/bin/env bash
# The GPU checks owed by the latest sessions in one call (carry .device-bundle, build/kernels
# from tools/gpu-kit.sh, build/probe-mma from `python tools/gpu_decode_mma_probe.py build
# build/probe-mma` and build/tune-append from `python -m kvtvm.tune --op append --cache-dtype
# int8|float8_e4m3fn --build-only build/tune-append --arch sm_90a`): every GPU test under
# tests/ (the fetch token's cache-ownership checks on CUDA among them); decode over float16 /
# int8 / e4m3 / K-only caches against their peers; the 8-bit decode's tuned kernel against its
# short_splits variant; the tensor-core 8-bit decode (numerics and speed); prefill over 8-bit
# caches; the host tier; the quantizing append's tuning; compute-sanitizer over the ops' GPU
# tests; the serving example and the Relax Llama. Each step has its own time limit so that one
# stuck step leaves the rest their time. Logs and JSON land in $OUT (8 files at most).
set -uo pipefail
source "$(dirname "$0")/gpu-env.sh"
step device nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv
step "decode mma probe" timeout 90 python3 tools/gpu_decode_mma_probe.py run build/probe-mma \
     --json "$OUT/decode-mma.json"
step "GPU tests" timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/compiler \
     tests/kernels tests/manager tests/ops tests/quant
step "bench decode" timeout 50 python3 -m kvtvm bench decode --device cuda --skip tvm \
     --cache-dtype float16 int8 float8_e4m3fn int8/none \
     --cases 16x4096 64x4096 1x32768 1x4096 --json "$OUT/bench-decode.json"
step "decode variants" timeout 50 python3 tools/gpu_decode_variant_probe.py \
     --json "$OUT/decode-variant.json"
step "bench prefill" timeout 40 python3 -m kvtvm bench prefill --device cuda --skip tvm \
     --cache-dtype int8 float8_e4m3fn --json "$OUT/bench-prefill.json"
step "host tier" timeout 25 python3 -m kvtvm.bench transfer --device cuda --skip transfer
step "tune append (prebuilt)" timeout 50 python3 -m kvtvm.tune --prebuilt build/tune-append \
     --device cuda --log-root /tmp/tuning_logs --no-progress
tar czf "$OUT/tuning_logs.tgz" -C /tmp/tuning_logs . 2>/dev/null
step "serve toy --device cuda bf16" timeout 45 python3 examples/serve.py --model toy --cache all \
     --device cuda --dtype bfloat16 --kernels build/kernels
for m in build/kernels/relax_llama_*.so; do
  step "relax_llama --device cuda" timeout 30 python3 examples/relax_llama.py --load "$m" \
       --device cuda
done
LOG=$LOG MEMCHECK_STEPS=ops timeout 90 bash tools/gpu-memcheck.sh || failed=$((failed + 1))
echo "=== $failed step(s) failed" | tee -a "$LOG"
exit "$failed"
