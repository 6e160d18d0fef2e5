#!/usr/bin/env bash
# The GPU checks owed by the latest sessions in one call (carry .device-bundle and
# build/kernels from tools/gpu-kit.sh): every GPU test of tools/gpu-check.sh; decode over
# float16 / int8 / e4m3 / K-only caches (one short sequence included) and prefill over 8-bit
# caches against their peers; the 8-bit decode's tuned kernel against its short_splits variant
# (ninth session: where the op should switch); the host tier in batches; then compute-sanitizer
# over the ops' GPU tests. Each step has its own time limit so that one stuck step leaves the
# rest their time. Logs and JSON land in $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu-env.sh"
step device nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv
tests=$(sed -n '/^step "GPU tests"/,/^for b/p' tools/gpu-check.sh | grep -o 'tests/[^ ]*')
step "GPU tests" timeout 160 python3 -m pytest -q -p no:cacheprovider -m gpu $tests
step "bench decode" timeout 75 python3 -m kvtvm bench decode --device cuda --skip tvm \
     --cache-dtype float16 int8 float8_e4m3fn int8/none \
     --cases 16x4096 64x4096 1x32768 1x4096 --json "$OUT/bench-decode.json"
step "decode variants" timeout 60 python3 tools/gpu_decode_variant_probe.py \
     --json "$OUT/decode-variant.json"
step "bench prefill" timeout 75 python3 -m kvtvm bench prefill --device cuda --skip tvm \
     --cache-dtype int8 float8_e4m3fn --json "$OUT/bench-prefill.json"
step "host tier" timeout 40 python3 -m kvtvm.bench transfer --device cuda --skip transfer
LOG=$OUT/gpu-memcheck.log MEMCHECK_STEPS=ops timeout 110 bash tools/gpu-memcheck.sh \
  || failed=$((failed + 1))
echo "=== $failed step(s) failed" | tee -a "$LOG"
exit "$failed"
