#!/usr/bin/env bash
# On the GPU machine: GPU-tier tests, then the small_h200 recipe with the reference ops.
# Results (logs, summary.json) go to $OUT (or ./gpu-out). Wheels for packages the image lacks are
# expected in .whl/ (see shared/gpu-wheels/README.md).
set -o pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
{
  date -u; git rev-parse --short HEAD 2>/dev/null
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"
python3 -m pytest -q -m gpu tests/ 2>&1 | tee "$OUT/gpu_tests.log"
python3 -m gemctl train --recipe small_h200 run.progress=false "$@" 2>&1 | tee "$OUT/small_h200.log"
cp runs/small_h200/*/summary.json "$OUT/small_h200_summary.json" 2>/dev/null
cp runs/small_h200/*/metrics.jsonl "$OUT/small_h200_metrics.jsonl" 2>/dev/null
