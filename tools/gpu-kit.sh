#!/usr/bin/env bash
# Builds, here (TVM's compiler and nvcc, no GPU needed), everything tools/gpu-check.sh runs on a
# GPU machine that has torch and the TVM runtime only:
#   build/kernels/   the CUDA kernels of the GPU tests, the benchmarks (and their TVM peer),
#                    examples/serve.py, and the whole Relax Llama of examples/relax_llama.py
#   .device-bundle/  the runtime-only TVM + tvm_ffi for Python 3.12 (../shared/tools/device-bundle.sh)
# Usage: PYTHON=.venv/bin/python ARCH=sm_90a tools/gpu-kit.sh      (ARCH=sm_80 for an A100)
# Then run tools/gpu-check.sh there, carrying .device-bundle and build/kernels.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PY=${PYTHON:-.venv/bin/python}
ARCH=${ARCH:-sm_90a}
OUT=build/kernels
build() { "$PY" -m kvtvm build --target cuda --arch "$ARCH" --out "$OUT" "$@" | tail -1; }

# GPU tests (pytest -m gpu): decode, prefill (every dtype, layout, window), copy, managers
build --ops decode --dtypes float16 --head-dims 128 --kv-heads 8 --group-sizes 4 --layouts nhd,hnd
build --ops prefill --dtypes float16,bfloat16,float32 --head-dims 128 --kv-heads 2 \
      --group-sizes 4 --layouts nhd,hnd --features none,sliding_window
build --ops copy --dtypes float16,bfloat16,float32 --head-dims 128
# prefill head shapes (tests/compiler/test_prefill_cuda_build.py::test_gpu_head_shapes)
build --ops prefill --dtypes float16 --head-dims 64 --kv-heads 2 --group-sizes 1 --layouts nhd
build --ops prefill --dtypes float16 --head-dims 128 --kv-heads 1 --group-sizes 3,8 --layouts nhd
build --ops prefill --dtypes float16 --head-dims 32 --kv-heads 2 --group-sizes 4 --layouts nhd
build --ops prefill --dtypes float16 --head-dims 96 --kv-heads 1 --group-sizes 5 --layouts nhd
build --ops prefill --dtypes float16 --head-dims 256 --kv-heads 1 --group-sizes 2 --layouts nhd
# benchmarks (Llama-3-8B layer: 8 KV heads x 128, group 4, float16) and the manager tests
# (hnd: the linear cache)
build --ops append,decode,prefill --dtypes float16 --head-dims 128 --kv-heads 8 --group-sizes 4 \
      --layouts nhd,hnd
# quantized caches (tests/quant/test_quant_cuda.py and bench decode --cache-dtype): the
# quantizing append and the quantized decode, int8 and float8_e4m3fn, both layouts
build --ops append,decode --dtypes float16 --head-dims 128 --kv-heads 4,8 --group-sizes 4 \
      --layouts nhd,hnd --cache-dtypes int8,float8_e4m3fn
# bench decode --dtype bfloat16 --cache-dtype bfloat16 int8 float8_e4m3fn: bfloat16 queries over
# 8-bit caches (the tensor-core decode) against the bfloat16 cache
build --ops append,decode --dtypes bfloat16 --head-dims 128 --kv-heads 8 --group-sizes 4 \
      --layouts nhd --cache-dtypes none,int8,float8_e4m3fn
# bench decode --cache-dtype int8/none (tools/gpu-check.sh): the K-only decode at the bench shape;
# V-only e4m3 there too (tools/gpu_decode_mma_probe.py times both against the tensor cores)
build --ops decode --dtypes float16 --head-dims 128 --kv-heads 8 --group-sizes 4 --layouts nhd \
      --cache-dtypes int8/none,none/float8_e4m3fn
# the quantizing append's other formats: mixed K/V storage, K-only, V-only (the non-finite decode
# test's V-only cache), bfloat16 and float32 rows
build --ops append --dtypes float16 --head-dims 128 --kv-heads 4,8 --layouts nhd --cache-dtypes int8/none
build --ops append --dtypes float16 --head-dims 128 --kv-heads 8 --layouts nhd \
      --cache-dtypes none/float8_e4m3fn
build --ops append --dtypes bfloat16 --head-dims 64 --kv-heads 4 --layouts hnd \
      --cache-dtypes int8/float8_e4m3fn
build --ops append --dtypes float32 --head-dims 128 --kv-heads 4 --layouts nhd \
      --cache-dtypes float8_e4m3fn/int8
# decode over a mixed K/V cache: K-only, V-only, K int8 + V fp8 (every kernel of
# tests/quant/test_quant_decode_mixed_cuda.py: keep in step with its KIT)
build --ops decode --dtypes float16 --head-dims 64,128 --kv-heads 2 --group-sizes 1,4,8 \
      --layouts nhd,hnd --cache-dtypes int8/none,none/int8,float8_e4m3fn/none,int8/float8_e4m3fn  # test_quant_decode_mixed_cuda
build --ops decode --dtypes float16 --head-dims 128 --kv-heads 2 --group-sizes 4 --layouts nhd \
      --features sliding_window --cache-dtypes int8/none,none/int8  # test_quant_decode_mixed_cuda
build --ops decode --dtypes bfloat16 --head-dims 128 --kv-heads 2 --group-sizes 4 --layouts nhd \
      --cache-dtypes int8/none  # test_quant_decode_mixed_cuda
build --ops decode --dtypes float32 --head-dims 128 --kv-heads 2 --group-sizes 4 --layouts hnd \
      --cache-dtypes none/float8_e4m3fn  # test_quant_decode_mixed_cuda
build --ops decode --dtypes float32 --head-dims 128 --kv-heads 2 --group-sizes 4 --layouts nhd \
      --cache-dtypes float8_e4m3fn  # test_quant_decode_mixed_cuda
build --ops decode --dtypes float16 --head-dims 80 --kv-heads 2 --group-sizes 4 --layouts nhd \
      --cache-dtypes int8/none  # test_quant_decode_mixed_cuda
build --ops decode --dtypes float16 --head-dims 48 --kv-heads 2 --group-sizes 1 --layouts hnd \
      --cache-dtypes none/float8_e4m3fn  # test_quant_decode_mixed_cuda
build --ops decode --dtypes float32 --head-dims 48 --kv-heads 2 --group-sizes 2 --layouts nhd \
      --cache-dtypes int8/float8_e4m3fn  # test_quant_decode_mixed_cuda
build --ops decode --dtypes float32 --head-dims 96 --kv-heads 2 --group-sizes 1 --layouts nhd \
      --cache-dtypes int8  # test_quant_decode_mixed_cuda
build --ops decode --dtypes bfloat16 --head-dims 112 --kv-heads 2 --group-sizes 2 --layouts nhd \
      --cache-dtypes int8  # test_quant_decode_mixed_cuda
# decode at head shapes off the grid (tests/ops/test_decode_cuda_shapes.py): heads of 3 or 5
# vectors a lane, and the shapes fit_row_groups refits
build --ops decode --dtypes float16 --head-dims 96 --kv-heads 2 --group-sizes 3 --layouts nhd
build --ops decode --dtypes float16 --head-dims 80 --kv-heads 2 --group-sizes 4 --layouts nhd
build --ops decode --dtypes float16 --head-dims 160 --kv-heads 2 --group-sizes 2 --layouts nhd
build --ops decode --dtypes float16 --head-dims 256 --kv-heads 2 --group-sizes 4,8 --layouts nhd
build --ops decode --dtypes float16 --head-dims 64 --kv-heads 2 --group-sizes 16 --layouts nhd \
      --cache-dtypes none,int8,float8_e4m3fn
build --ops decode --dtypes float16 --head-dims 256 --kv-heads 2 --group-sizes 4 --layouts nhd \
      --cache-dtypes int8
build --ops decode --dtypes float16 --head-dims 256 --kv-heads 2 --group-sizes 8 --layouts nhd \
      --cache-dtypes int8,float8_e4m3fn
# 8-bit heads of 48, 80, 96, 112 (float16 queries: the tensor cores since 2026-11-28, V's last
# 32-column group zero-padded; the CUDA cores' 3, 5 or 7 words a lane serve float32 queries)
build --ops decode --dtypes float16 --head-dims 48 --kv-heads 2 --group-sizes 4 --layouts nhd \
      --cache-dtypes int8
build --ops decode --dtypes float16 --head-dims 80 --kv-heads 2 --group-sizes 2 --layouts nhd \
      --cache-dtypes float8_e4m3fn
build --ops decode --dtypes float16 --head-dims 96 --kv-heads 2 --group-sizes 4 --layouts nhd \
      --cache-dtypes int8
build --ops decode --dtypes float16 --head-dims 96 --kv-heads 2 --group-sizes 8 --layouts nhd \
      --cache-dtypes float8_e4m3fn
build --ops decode --dtypes float16 --head-dims 112 --kv-heads 2 --group-sizes 2,8 --layouts nhd \
      --cache-dtypes int8
# GQA 8 at d80 / d48, and d16 (the CUDA cores: row groups capped at 64 along threadIdx.z)
build --ops decode --dtypes float16 --head-dims 80 --kv-heads 2 --group-sizes 8 --layouts nhd \
      --cache-dtypes float8_e4m3fn
build --ops decode --dtypes float16 --head-dims 48 --kv-heads 2 --group-sizes 8 --layouts nhd \
      --cache-dtypes int8
build --ops decode --dtypes float16 --head-dims 16 --kv-heads 2 --group-sizes 1 --layouts nhd \
      --cache-dtypes int8
# GQA past 8 on the tensor cores in head parts (6 + 6, 5 + 4; GQA 16 is built above)
build --ops decode --dtypes float16 --head-dims 128 --kv-heads 2 --group-sizes 12 --layouts nhd \
      --cache-dtypes int8
build --ops decode --dtypes float16 --head-dims 64 --kv-heads 2 --group-sizes 9 --layouts nhd \
      --cache-dtypes float8_e4m3fn
# GQA past 16 (4 x 8 and 7 + 7 + 6 query heads; twenty-second session) and the float16 cache's
# decode beside them for tools/gpu-changed.sh's speed line
build --ops decode --dtypes float16 --head-dims 128 --kv-heads 2 --group-sizes 32 --layouts nhd \
      --cache-dtypes none,int8,float8_e4m3fn
build --ops decode --dtypes float16 --head-dims 64 --kv-heads 2 --group-sizes 20 --layouts nhd \
      --cache-dtypes float8_e4m3fn
# speed off the Llama grid (tools/gpu-changed.sh's bench decode at these heads): the float16 cache's
# decode and the quantizing append beside the 8-bit decodes above
# (heads of 64 at GQA 16: the decode kernels are built above; K-only / V-only at d128 GQA 8:
# the mixed-decode lines below)
build --ops decode --dtypes float16 --head-dims 80,48,128 --kv-heads 2 --group-sizes 8 \
      --layouts nhd
build --ops append --dtypes float16 --head-dims 80,48,64 --kv-heads 2 --layouts nhd \
      --cache-dtypes int8,float8_e4m3fn
build --ops append --dtypes float16 --head-dims 128 --kv-heads 2 --layouts nhd \
      --cache-dtypes int8/none,none/float8_e4m3fn,int8,float8_e4m3fn
build --ops decode --dtypes float16 --head-dims 128 --kv-heads 2 --group-sizes 8,16 \
      --layouts nhd --cache-dtypes none,int8/none,none/float8_e4m3fn
# float32 queries (the CUDA-core kernel) against the float32 cache
build --ops append,decode --dtypes float32 --head-dims 128 --kv-heads 2 --group-sizes 4 \
      --layouts nhd --cache-dtypes none,int8
# CUDA prefill over 8-bit caches (tests/quant/test_quant_prefill_cuda.py: one line a case;
# K-only, V-only and mixed formats; float32 queries through the simt kernel)
build --ops prefill --dtypes float16 --head-dims 128 --kv-heads 2 --group-sizes 4 --layouts nhd \
      --cache-dtypes int8 --features none
build --ops prefill --dtypes float16 --head-dims 128 --kv-heads 2 --group-sizes 4 --layouts nhd \
      --cache-dtypes float8_e4m3fn --features sliding_window
build --ops prefill --dtypes bfloat16 --head-dims 128 --kv-heads 2 --group-sizes 4 --layouts hnd \
      --cache-dtypes int8 --features sliding_window
build --ops prefill --dtypes bfloat16 --head-dims 128 --kv-heads 2 --group-sizes 4 --layouts hnd \
      --cache-dtypes float8_e4m3fn --features none
build --ops prefill --dtypes float16 --head-dims 128 --kv-heads 2 --group-sizes 1 --layouts nhd \
      --cache-dtypes int8/none --features none
build --ops prefill --dtypes bfloat16 --head-dims 128 --kv-heads 1 --group-sizes 8 --layouts nhd \
      --cache-dtypes none/float8_e4m3fn --features sliding_window
build --ops prefill --dtypes float16 --head-dims 128 --kv-heads 2 --group-sizes 4 --layouts hnd \
      --cache-dtypes float8_e4m3fn/int8 --features none
build --ops prefill --dtypes bfloat16 --head-dims 64 --kv-heads 2 --group-sizes 2 --layouts nhd \
      --cache-dtypes int8 --features none
build --ops prefill --dtypes float32 --head-dims 128 --kv-heads 2 --group-sizes 4 --layouts nhd \
      --cache-dtypes int8/float8_e4m3fn --features none
# bench prefill --cache-dtype int8 float8_e4m3fn (the Llama-3-8B layer; its quantizing append
# is built above)
build --ops prefill --dtypes float16 --head-dims 128 --kv-heads 8 --group-sizes 4 --layouts nhd \
      --cache-dtypes int8,float8_e4m3fn
# TVM 0.27's built-in decode and prefill kernels, the benchmarks' peer (no compiler there)
"$PY" -m kvtvm.bench.tvm_peer --arch "$ARCH" --out "$OUT" | tail -1
# examples/serve.py --model toy --device cuda, float32 and bfloat16 (the toy Llama: 8 query
# heads, 2 KV heads of 32, GQA 4; nhd for paged/continuous, hnd for linear; copy: n_kv_heads 1)
build --ops append,prefill,decode,copy --dtypes float32,bfloat16 --head-dims 32 --kv-heads 1,2 \
      --group-sizes 4 --layouts nhd,hnd
# examples/serve.py --device cuda --dtype bfloat16 (SmolLM2: 3 KV heads of 64, GQA 3;
# nhd for paged/continuous, hnd for linear; copy for the linear cache's eviction)
build --ops append,prefill,decode,copy --dtypes bfloat16 --head-dims 64 --kv-heads 3 \
      --group-sizes 3 --layouts nhd,hnd

# the Relax Llama (examples/relax_llama.py), compiled for CUDA and exported whole
"$PY" examples/relax_llama.py --export "$OUT/relax_llama_$ARCH.so" --arch "$ARCH" | tail -1

PYTHON="$PY" ../shared/tools/device-bundle.sh >/dev/null
du -sh "$OUT" .device-bundle
echo "carry: [\".device-bundle\", \"$OUT\"]   command: bash tools/gpu-check.sh"
