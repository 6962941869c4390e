#!/usr/bin/env bash
# On the GPU machine: kernel benchmark, then the whole-model step with the Triton jagged attention.
set -o pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
F='fbgemm\|WARNING\|\[0m\|\[33m\|^ *$\|determine compat'
python3 scripts/bench_jagged_attention.py --out "$OUT/bench_jagged_attention.json" 2>&1 | grep -v "$F" | tee "$OUT/bench_jagged_attention.log"
python3 -m gemctl train --recipe small_h200 run.progress=false 2>&1 | grep -v "$F" | tee "$OUT/small_h200_triton.log"
cp runs/small_h200/*/summary.json "$OUT/small_h200_triton_summary.json" 2>/dev/null
