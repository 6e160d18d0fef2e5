#!/usr/bin/env bash
# Runs on a GPU machine with torch (CUDA) but no TVM compiler, in a checkout carrying
# .device-bundle and build/kernels (from tools/gpu-kit.sh): the GPU tests, the benchmarks
# (JSON), the serving example and the Relax Llama on CUDA. Everything lands in $OUT (default
# ./gpu-check-out): gpu-check.log and bench-<name>.json -- five files, under the device tool's
# limit of eight.
# A failing step is logged and the next one still runs; the exit status counts the failures.
set -uo pipefail
source "$(dirname "$0")/gpu-env.sh"
step device nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv
step "GPU tests" python3 -m pytest -q -p no:cacheprovider -m gpu \
     tests/compiler/test_decode_cuda_build.py tests/compiler/test_prefill_cuda_build.py \
     tests/kernels tests/ops/test_copy_kernel.py tests/ops/test_bounds_cuda.py \
     tests/manager/test_manager_cuda.py \
     tests/manager/test_manager_linear_cuda.py tests/quant/test_quant_cuda.py \
     tests/quant/test_quant_decode_mixed_cuda.py tests/quant/test_quant_prefill_cuda.py \
     tests/ops/test_decode_cuda_shapes.py \
     tests/manager/test_checksums_cuda.py tests/manager/test_manager_tier_batches.py
for b in append copy decode prefill; do
  extra=()  # quantized caches side by side (their kernels: tools/gpu-kit.sh)
  case $b in decode) extra=(--cache-dtype float16 int8 float8_e4m3fn int8/none) ;;
             prefill) extra=(--cache-dtype int8 float8_e4m3fn) ;; esac
  step "bench $b" python3 -m kvtvm bench "$b" --device cuda ${extra[@]+"${extra[@]}"} \
       --json "$OUT/bench-$b.json"
done
# the host tier's batched demote / promote against plain pinned copies, both directions
step "bench transfer (host tier)" python3 -m kvtvm bench transfer --device cuda --skip transfer
step "bench host" python3 -m kvtvm bench host --device cuda --head-dim 32  # serve.py's kernels
step "serve --device cuda" python3 examples/serve.py --model toy --device cuda --dtype float32 \
     --kernels build/kernels
# the toy in bfloat16 over all three caches with the token check against transformers (SmolLM2
# itself travels in three calls: tools/gpu-smollm2.sh)
step "serve toy --device cuda bf16" python3 examples/serve.py --model toy --cache all \
     --device cuda --dtype bfloat16 --kernels build/kernels
for m in build/kernels/relax_llama_*.so; do
  step "relax_llama --device cuda" python3 examples/relax_llama.py --load "$m" --device cuda
done
echo "=== $failed step(s) failed" | tee -a "$LOG"
exit "$failed"
