#!/usr/bin/env bash
# Run measurement stages on the GPU machine; logs and result files go to $OUT (or ./gpu-out).
#
#   bash scripts/gpu.sh tests baseline bench profile
#
#   tests     the GPU tier of the test suite (pytest -m gpu)
#   baseline  gemctl train --recipe small_h200 (summary.json copied out)
#   bench     scripts/bench_jagged_attention.py (ours vs FA2 varlen, flex_attention, padded SDPA)
#   bench-gdpa scripts/bench_gdpa.py (ours vs padded bmm-act-bmm eager/compiled, softmax; roofline)
#   bench-block scripts/bench_block_attention.py (block attention + fused RoPE vs memory roofline,
#             full jagged attention, separate rotary kernels; self-1000 and self-4000)
#   profile   gemctl profile --recipe small_h200 (profile.json and plots copied out)
#   ab-gdpa   small_h200 with model.kernels.gdpa=torch, then =triton (whole-model before/after)
#
# Packages the GPU image lacks travel as wheels in .whl/ (shared/gpu-wheels/README.md).
set -o pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
quiet() { grep -v 'fbgemm\|WARNING\|\[0m\|\[33m\|^ *$\|determine compat'; }
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } 2>&1 | tee "$OUT/env.txt"
for stage in "$@"; do
  case "$stage" in
    tests) python3 -m pytest -q -m gpu tests/ 2>&1 | tail -20 | tee "$OUT/gpu_tests.log" ;;
    baseline)
      python3 -m gemctl train --recipe small_h200 run.progress=false 2>&1 | quiet | tee "$OUT/small_h200.log"
      cp "$(ls -d runs/small_h200/* | tail -1)/summary.json" "$OUT/small_h200_summary.json" ;;
    bench) python3 scripts/bench_jagged_attention.py --out "$OUT/bench_jagged_attention.json" 2>&1 | quiet | tee "$OUT/bench_jagged_attention.log" ;;
    bench-gdpa) python3 scripts/bench_gdpa.py --grids --out "$OUT/bench_gdpa.json" 2>&1 | quiet | tee "$OUT/bench_gdpa.log" ;;
    bench-block) python3 scripts/bench_block_attention.py --out "$OUT/bench_block_attention.json" 2>&1 | quiet | tee "$OUT/bench_block_attention.log" ;;
    ab-gdpa)
      for impl in torch triton; do
        python3 -m gemctl train --recipe small_h200 run.progress=false model.kernels.gdpa=$impl run.name=small_h200-gdpa-$impl 2>&1 | quiet | tee "$OUT/small_h200_gdpa_$impl.log"
        cp "$(ls -d runs/small_h200-gdpa-$impl/* | tail -1)/summary.json" "$OUT/small_h200_gdpa_${impl}_summary.json"
      done ;;
    profile)
      python3 -m gemctl profile --recipe small_h200 2>&1 | quiet | tee "$OUT/profile.log"
      d=$(ls -d runs/small_h200-profile/* | tail -1)
      cp "$d/profile.json" "$d/breakdown.png" "$d/waterfall.png" "$OUT/" ;;
    *) echo "gpu.sh: unknown stage '$stage' (tests, baseline, bench, bench-gdpa, bench-block, ab-gdpa, profile)" >&2; exit 2 ;;
  esac
done
