#!/usr/bin/env bash
# Runs on a GPU machine (see tools/gpu-env.sh), in a checkout carrying .device-bundle and
# build/tune: times every candidate that `python -m kvtvm.tune --build-only build/tune --arch
# ARCH` built here and writes the best of each spec to $OUT/tuning_logs.tgz (unpack it into
# tuning_logs/ and commit), with the trials in gpu-tune.log.
# Usage there: bash tools/gpu-tune.sh [--op OP]
set -uo pipefail
LOG=${OUT:-$PWD/gpu-check-out}/gpu-tune.log
source "$(dirname "$0")/gpu-env.sh"
step "tune (prebuilt candidates)" python3 -m kvtvm.tune --prebuilt build/tune --device cuda \
     --log-root /tmp/tuning_logs "$@"
step "trials" python3 - <<'PY'
import json, pathlib
for p in sorted(pathlib.Path("/tmp/tuning_logs").glob("*/*.json")):
    e = json.loads(p.read_text())
    timed = sorted(((t["median_ms"], t["knobs"]) for t in e["trials"] if "median_ms" in t),
                   key=lambda t: t[0])
    print(f"{e['uri']}: default {e['default_ms']:.4f} ms, best {e['median_ms']:.4f} ms "
          f"{e['knobs']}; {len(timed)} timed of {len(e['trials'])}")
    for ms, knobs in timed[:5]:
        print(f"    {ms:.4f} ms  {knobs}")
PY
tar czf "$OUT/tuning_logs.tgz" -C /tmp/tuning_logs .
exit "$failed"
