#!/usr/bin/env bash
# On the GPU machine: GPU tier of the attention tests, then the kernel benchmark.
set -o pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -m pytest -q -m gpu -x tests/test_jagged_attention_triton.py 2>&1 | tail -15 | tee "$OUT/gpu_tests_jfa.log"
python3 scripts/bench_jagged_attention.py --out "$OUT/bench_jagged_attention.json" "$@" 2>&1 | grep -v "fbgemm\|WARNING\|\[0m\|\[33m\|^ *$\|determine compat" | tee "$OUT/bench_jagged_attention.log"
