#!/usr/bin/env bash
# The prepared GPU check (issue 18), for a CUDA machine without internet that has torch, transformers,
# peft, pyyaml, rich, numpy, safetensors and pytest but not rolerl's other dependencies (they are only
# imported by tasks and tools this check does not use). Run from anywhere:
#   bash benchmarks/gpu_check.sh [--shapes qwen3-0.6b]      # ~5-10 min on one H200
# Writes $OUT/pytest_cuda.log and $OUT/gpu_check.json (OUT defaults to /tmp/gpu_check); the last line
# printed is the JSON summary. Exit status 0 only if every judged check passed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# 1. the CUDA tests (engine greedy == HF, rollout log-probs == trainer recompute, fp32 and bf16)
$PY -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest_cuda.log"
rc=${PIPESTATUS[0]}
# 2. Qwen3-0.6B/1.7B-shaped checks, throughput vs HF generate, a short GRPO run, NCCL with 2+ GPUs
$PY benchmarks/gpu_check.py --out "$OUT" --pytest-rc "$rc" "$@" 2>"$OUT/gpu_check.stderr"
status=$?
[ $status -ne 0 ] && tail -30 "$OUT/gpu_check.stderr"
python3 -c "import json,sys; sys.exit(0 if json.load(open('$OUT/gpu_check.json'))['pass'] else 1)" 2>/dev/null
