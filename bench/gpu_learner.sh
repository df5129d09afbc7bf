#!/usr/bin/env bash
# The learner on one CUDA GPU, in one command: tokens/s, MFU and the streaming overhead.
#
#     bash bench/gpu_learner.sh                      # ~1B-parameter Llama, bf16 autocast
#     bash bench/gpu_learner.sh --size 0.5b --batch-size 16
#     bash bench/gpu_learner.sh --dry-run            # CPU, a tiny config: checks the script
#
# Runs bench/gpu_learner.py (its docstring says what is measured) with the repository's
# interpreter (.venv/bin/python when there is one, else python3), writing its JSON to
# $OUT/gpu_learner.json ($OUT defaults to a temp dir) and its files beside it. Extra
# arguments go to gpu_learner.py. Without a CUDA device it stops at once (exit 2).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
if ! "$PY" -c "import torch, transformers, ddiloco.learner.hf" 2>/dev/null; then
    echo "gpu_learner.sh: $PY lacks torch, transformers or ddiloco: pip install -e '.[train]'" >&2
    exit 2
fi
OUT="${OUT:-$(mktemp -d -t gpu-learner-XXXXXX)}"
mkdir -p "$OUT"
exec "$PY" bench/gpu_learner.py --out "$OUT/run" --json "$OUT/gpu_learner.json" "$@"
