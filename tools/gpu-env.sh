# Sourced by the tools/gpu-*.sh scripts on a GPU machine with torch (CUDA) but no TVM compiler:
# installs the runtime-only TVM of .device-bundle (tools/gpu-kit.sh) into /tmp/site, points
# kvtvm at the prebuilt kernels, makes $OUT and defines `step NAME COMMAND...`, which runs,
# logs to $LOG and counts a failure in $failed without stopping the script.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
LOG=${LOG:-$OUT/gpu-check.log}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device-bundle/*.whl \
  && tar xzf .device-bundle/tvm-runtime.tgz -C /tmp/site || { echo "bundle install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD TVM_USE_RUNTIME_LIB=1 PYTHONUNBUFFERED=1 \
       KVTVM_KERNEL_PATH=$PWD/build/kernels KVTVM_CACHE_DIR=/tmp/kvtvm-no-cache
failed=0
step() {  # step NAME COMMAND...: run, log, count a failure
  echo "=== $1 ($(date -u +%H:%M:%S))" | tee -a "$LOG"
  shift
  "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { failed=$((failed + 1)); echo "=== FAILED (exit $rc)" | tee -a "$LOG"; }
}
