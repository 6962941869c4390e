#!/usr/bin/env bash
# Run measurement stages on the GPU machine; logs and result files go to $OUT (or ./gpu-out).
#
#   bash scripts/gpu.sh tests baseline bench profile
#   PACK=1 bash scripts/gpu.sh ...   everything under $OUT left in one results.tgz at the end
#   REQUIRE_GPU=H200 bash scripts/gpu.sh ...   run nothing (exit 3) unless the GPU's name has that
#                                              text: a call that got another card spends no more time
#
#   tests     the GPU tier of the test suite (pytest -m gpu)
#   baseline  gemctl train --recipe small_h200 (summary.json copied out)
#   bench     scripts/bench_jagged_attention.py (ours vs FA2 varlen, flex_attention, padded SDPA)
#   bench-gdpa scripts/bench_gdpa.py (ours vs padded bmm-act-bmm eager/compiled, softmax; roofline)
#   bench-block scripts/bench_block_attention.py (block attention + fused RoPE vs memory roofline,
#             full jagged attention, separate rotary kernels; self-1000 and self-4000)
#   profile   gemctl profile --recipe small_h200 (profile.json and plots copied out)
#   ab-gdpa   small_h200 with model.kernels.gdpa=torch, then =triton (whole-model before/after)
#   every     every autotune candidate of the jagged, block and GDPA kernels pinned in turn against
#             float64 (element-wise bounds too); compile-bound: with pytest-xdist (a wheel in .whl/)
#             14 workers, else three pytest processes at once (140+ tests: more than one 10-minute
#             call without xdist). EVERY_K narrows the selection (pytest -k expression).
#   sweep-block scripts/bench_block_attention.py --sweep: every block-attention candidate (TMA too)
#             timed against the memory roofline
#   block-hopper  the Gluon block-attention kernels (block_attention_hopper.py): their GPU tier (float64
#             checks, the every-candidate and determinism tests) and then, only if that passed, the
#             forward and backward sweep of the Triton picks against the Hopper configs (self-1000,
#             self-4000)
#   block-records  the block-attention picks reading their block from a work record (seventh field 1):
#             their GPU tier (the every-candidate test), then, only if that passed, the forward and
#             backward sweep of them against the picks (self-1000, self-4000), twice in turn
#   block-ab  the Gluon block-attention kernels of this tree against those of BASE_TREE (a directory
#             holding another tree, e.g. `git archive <rev> | tar -x -C base`): the forward and
#             backward sweeps (AB_FWD / AB_BWD configs, default the Gluon ones; self-1000, self-4000)
#             alternating between the two trees, twice each, then this tree's Hopper GPU tier
#   (block-ab, block-partial: AB_TABLES=fp32 (or bf16) times the rope tables in that dtype, not fp16;
#   block-ab, gdpa-ab: AB_TREE=<dir> times that tree in place of this one against BASE_TREE (the GPU
#   tier after the sweeps stays this tree's; AB_TIER=0 leaves it out); block-ab, block-partial,
#   gdpa-ab: SM_LIMIT=h200 or a number of SMs runs the sweeps under scripts/sm_limit.py)
#   proxy-check  whether an H100 held to an H200's bandwidth per SM (scripts/sm_limit.py --h200, or
#             SM_LIMIT) ranks the block backward's ring restructure against its base as the H200 did
#             (10-12% faster there, 2-4% slower on a whole H100): both trees from this copy's git,
#             swept twice in turn, beside the H200's and the H100's runs; then GDPA cross-128's and
#             cross-32's Gluon forwards on the base tree (71% of the roofline on the H200, 83-84% on
#             a whole H100) the same way (proxy_check.md)
#   block-partial  this tree's Gluon block-attention sweep (AB_FWD / AB_BWD) of self-1000 and self-4000
#             beside the same with every length rounded up to whole 64-row blocks (--whole-blocks):
#             what the partial blocks and the rows past the sequences cost; twice
#   gdpa-ab   the same for the Gluon GDPA forwards: cross-128, cross-32 and self-1000 timed with
#             the Gluon configs (AB_GDPA; default the warp-specialized and resident forwards, the
#             streaming one) in both trees in turn, twice, then this tree's Hopper GPU tier
#             (AB_TIER=0 leaves both stages' GPU tier out: the sweeps of both first, the tiers later)
#   cast-ab   the FP8 casts of this tree against those of BASE_TREE: bench_fp8.py --only cast at
#             [65536, AB_CAST_WIDTHS (default 1024)] in both trees in turn, twice, each tree with its own
#             autotune cache (AB_PENDING=1 adds --pending: the pinned-only cast configs timed too),
#             then this tree's GPU tier of the casts
#   gdpa-probes  bench_gdpa.py's timing probes of the Gluon cross-128 forward (memory alone, math
#             alone, against the pick) and the self-1000 forward against the softmax one, 10 A/B rounds
#   gdpa-ws   the warp-specialized GDPA forwards (gdpa_hopper._gdpa_fwd_ws, _gdpa_fwd_ws_stream): their
#             GPU tier under a 90 s limit per test, then, only if that passed, cross-128 and cross-32
#             (resident) and self-1000 (streaming) against the picks
#   bench-mx  scripts/bench_mx.py: MX quantize kernels, Python call and CUDA-graph time, vs copy
#   tests-precision  the GPU tier of the FP8, MX and MX-attention tests alone (~1-2 minutes)
#   bench-fp8 scripts/bench_fp8.py --only cast,mlp --pending: the FP8 casts vs copy, the MLP block vs
#             BF16, the cast configs the GPU tier has not passed yet autotuned too (JSON: configs)
#   ablation-precision  the precision recipes' NE ablation (recipes/ablation_precision.yaml), 3 seeds, on
#             MovieLens-100K and synthetic data: ABLATION_RECIPES (default bf16,fp8_mlp,mxfp8_safe,
#             the issue's set), ABLATION_DATA, ABLATION_OVERRIDES (e.g. "train.lr=3e-3"); the settings
#             tables in ablation.md, each dataset's sweep and job summaries (losses, gradient norms) in
#             ablation_<data>.tgz; ABLATION_PARALLEL=1 runs every dataset x recipe multirun at once
#   bench-fp8-issue  issue 6's speed bars in one run: the fused MLP block's casts at 1024, 4096,
#             2048 and 8192 columns (those it runs at each), the block against compiled BF16 at d = 1024 and 2048
#   bench-fp8-model  the casts at small_h200's shapes (89,569 jagged tokens; d_model 768 and its
#             3072-wide MLP), pending configs included
#   sweep     scripts/bench_jagged_attention.py --sweep fwd/dkdv/dq: every candidate of each pass timed
#   ncu       Nsight Compute counters of one autotuned forward+backward: jagged attention self-1000,
#             GDPA cross-128, block attention (64, RoPE) self-1000. Autotuning under ncu can pick other
#             configs than the benchmark (the GDPA forward did, 2026-11-30): the log names the configs it
#             profiled, and NCU_PIN_JAGGED / NCU_PIN_GDPA / NCU_PIN_BLOCK ("--pin KERNEL=CFG ...") pin them
#   ncu-sass  where a kernel's warps wait, per SASS instruction (Nsight Compute warp-state sampling;
#             scripts/sass_stalls.py summarizes the source page), for each config of NCU_SASS_CONFIGS.
#             NCU_SASS_TARGET=gdpa (default): GDPA cross-128's forward, the resident Gluon pick and its
#             math-alone probe; =block: block attention's self-1000 backward (block 64, RoPE), the
#             Triton pick and the Gluon backward
#   checkpoint  small_h200 under each activation-checkpointing mode (CKPT_MODES, default none ops full)
#             at each batch size (CKPT_BATCHES, default 64 256), 30 steps (10 untimed): one multirun
#             per batch size, its table with step time, MFU, HFU and peak memory per mode (a job that
#             runs out of memory shows its exit code). CKPT_OVERRIDES adds overrides to every job
#   tests-multi-gpu  the two-GPU checks (2+ GPUs): FSDP, HSDP and EP+MoE over NCCL against one
#             process (pytest -m gpu -k two_gpus)
#   profile-multi-gpu  gemctl profile of small_h200 with FSDP over every GPU (where the step goes
#             beyond one GPU's: communication, exposed and straggler time per rank)
#   scaling   small_h200 with FSDP over every GPU and its Scaling Ratio against rank 0's
#             single-GPU baseline (metrics.scaling_baseline_steps), plain batches then BBS
#   precision-speed  small_h200 once per precision recipe (PRECISION_RECIPES, default bf16,fp8_tower,
#             fp8_mlp,fp8), autotuned, 80 steps (40 untimed) and smaller item/user tables (the step
#             compares recipes, not the baseline). Each FP8 recipe tunes for ~70-250 s from a cold
#             cache: two or three recipes per 10-minute call; carry .autotune to the next call.
#             PRECISION_OVERRIDES adds overrides to every job (e.g. "model.d_model=1536 model.num_heads=12")
#
# Packages the GPU image lacks travel as wheels in .whl/ (shared/gpu-wheels/README.md). Tuned kernel
# configs go to .autotune/ (GEMCTL_CACHE_DIR) and come back in one file, $OUT/autotune.tar (a call
# returns a few files only): unpacked into .autotune and carried to the next call (the device
# tool's carry), the kernels whose source did not change start tuned instead of compiling and
# timing every candidate again.
set -o pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export GEMCTL_CACHE_DIR=${GEMCTL_CACHE_DIR:-$PWD/.autotune}
OUT=$(cd "$OUT" && pwd)
# PACK=1: at exit, every file under $OUT goes into one $OUT/results.tgz (and only there), for
# transports that bring back a few files only; the run's status is kept.
on_exit() {
  local rc=$?
  (cd "$GEMCTL_CACHE_DIR" 2>/dev/null && tar -cf "$OUT/autotune.tar" autotune-*.json 2>/dev/null)
  if [ "${PACK:-0}" = 1 ]; then
    local packed; packed=$(mktemp)
    tar -czf "$packed" -C "$OUT" --exclude=./results.tgz . && find "$OUT" -mindepth 1 -delete \
      && mv "$packed" "$OUT/results.tgz"
  fi
  exit $rc
}
trap on_exit EXIT
if [ -n "${REQUIRE_GPU:-}" ]; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>&1 | head -1)
  case "$gpu" in
    *"$REQUIRE_GPU"*) ;;
    *) echo "gpu.sh: REQUIRE_GPU=$REQUIRE_GPU but this machine has: $gpu; nothing run" | tee "$OUT/env.txt" >&2
       exit 3 ;;
  esac
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
# SM_LIMIT=h200 or a number: the A/B sweeps (block-ab, block-partial, gdpa-ab) run under
# scripts/sm_limit.py, held to the SMs that give this GPU an H200's copy bandwidth per SM (an H100:
# 94 of 132) or to that many SMs: a proxy for the H200 on an H100 (sm_limit.py says how far to trust it)
# held_py LIMIT: sweep_py for h200 (resolved once: every run of an A/B holds the same SMs) or N SMs
held_py() {
  case "$1" in
    h200) local n; n=$(python3 "$PWD/scripts/sm_limit.py" --h200 --resolve) || exit 2
          sweep_py=(python3 "$PWD/scripts/sm_limit.py" --sms "$n") ;;
    *[!0-9]*|"") echo "gpu.sh: SM_LIMIT is h200 or a number of SMs, got '$1'" >&2; exit 2 ;;
    *) sweep_py=(python3 "$PWD/scripts/sm_limit.py" --sms "$1") ;;
  esac
}
sweep_py=(python3)
[ -z "${SM_LIMIT:-}" ] || held_py "$SM_LIMIT"
quiet() { grep -v 'fbgemm\|WARNING\|\[0m\|\[33m\|^ *$\|determine compat'; }
# ab_trees NAME PREFIX SCRIPT ARGS...: SCRIPT ARGS in this tree (or AB_TREE, a directory holding
# another) and in BASE_TREE in turn, twice (PREFIX_{this,base}_{1,2}.json; the lines with times in
# NAME's log); under sm_limit.py with SM_LIMIT
ab_trees() {
  local name=$1 prefix=$2 round tree tag; shift 2
  [ -d "${BASE_TREE:-}" ] || { echo "gpu.sh $name-ab: BASE_TREE must name a directory holding the tree to compare with, got '${BASE_TREE:-}'" >&2; exit 2; }
  [ -d "${AB_TREE:-.}" ] || { echo "gpu.sh $name-ab: AB_TREE must name a directory holding a tree, got '$AB_TREE'" >&2; exit 2; }
  local base this; base=$(cd "$BASE_TREE" && pwd); this=$(cd "${AB_TREE:-.}" && pwd)
  [ "$base" != "$this" ] || { echo "gpu.sh $name-ab: BASE_TREE and the tree timed against it are both $base" >&2; exit 2; }
  for round in 1 2; do
    for tree in "$this" "$base"; do
      tag=$([ "$tree" = "$this" ] && echo this || echo base)
      # each tree its own autotune cache: the same key in both would hand one tree the other's picks
      (cd "$tree" && PYTHONPATH="/tmp/site:$tree" GEMCTL_CACHE_DIR="/tmp/gemctl_ab_cache_$tag" timeout 150 \
        "${sweep_py[@]}" "$@" --out "${prefix}_${tag}_$round.json") 2>&1 \
        | quiet | grep " ms\|us \|copy\|%\|sm_limit" | sed "s/^/$tag /" | tee -a "$OUT/ab_$name.log"
    done
  done
}
# proxy_check: the H200 stand-in (scripts/sm_limit.py) against the H200's own runs. The block
# backward's ring restructure (60f030c; e2da711 has the same SASS) against its base (4a23c5d) was
# 10-12% faster on the H200 and 2-4% slower on a whole H100 (docs/runs/2026-12-06_sweep_block_bwd_ring_*)
proxy_check() {
  local tmp r; tmp=$(mktemp -d) && mkdir -p "$tmp/ring" "$tmp/base"
  if ! { git archive e2da711 | tar -x -C "$tmp/ring" && git archive 4a23c5d | tar -x -C "$tmp/base"; }; then
    echo "gpu.sh proxy-check: this copy's git lacks e2da711 or 4a23c5d (git archive failed)" >&2; exit 2
  fi
  local -a sweep_py=("${sweep_py[@]}")  # ab_trees sees this one (bash scopes dynamically)
  [ -n "${SM_LIMIT:-}" ] || held_py h200
  AB_TREE=$tmp/ring BASE_TREE=$tmp/base ab_trees proxy "$OUT/proxy_block" scripts/bench_block_attention.py --sweep \
    --only self-1000 self-4000 --fwd-configs 4,1,1,0,0,3 --bwd-configs 4,1,1,0,0,2
  r=docs/runs/2026-12-06_sweep_block_bwd_ring
  python3 scripts/compare_sweeps.py --ratio "proxy ring/proxy base" \
    --group "proxy ring=$OUT/proxy_block_this_1.json,$OUT/proxy_block_this_2.json" \
    --group "proxy base=$OUT/proxy_block_base_1.json,$OUT/proxy_block_base_2.json" \
    --group "H200 ring=${r}_1_h200.json,${r}_2_h200.json" --group "H200 base=${r}_base_1_h200.json,${r}_base_2_h200.json" \
    --group "H100 ring=${r}_1_h100.json,${r}_2_h100.json" --group "H100 base=${r}_base_1_h100.json,${r}_base_2_h100.json" \
    | tee "$OUT/proxy_check.md"
  # GDPA cross-128 / cross-32's Gluon forwards on the base tree: 71% of the roofline on the H200,
  # 83-84% on a whole H100 (docs/runs/2026-12-06_grid_gdpa_record_lanes_base_*)
  local round
  for round in 1 2; do
    (cd "$tmp/base" && PYTHONPATH="/tmp/site:$tmp/base" timeout 150 "${sweep_py[@]}" scripts/bench_gdpa.py --grid-only \
      --only cross-128 cross-32 --grid-configs 64,128,4,4,1,16,0,0,2,2 64,128,4,2,2,16,0,0,1,1 \
      --out "$OUT/proxy_gdpa_$round.json") 2>&1 | quiet | grep "sm_limit\|copy" | tee -a "$OUT/ab_proxy.log"
  done
  r=docs/runs/2026-12-06_grid_gdpa_record_lanes_base
  python3 scripts/compare_sweeps.py \
    --group "proxy base=$OUT/proxy_gdpa_1.json,$OUT/proxy_gdpa_2.json" \
    --group "H200 base=${r}_1_h200.json,${r}_2_h200.json" --group "H100 base=${r}_1_h100.json,${r}_2_h100.json" \
    | tee -a "$OUT/proxy_check.md"
}
# the Gluon block-attention sweep that block-ab and block-partial time (AB_FWD / AB_BWD configs)
gluon_block_sweep=(scripts/bench_block_attention.py --sweep --only self-1000 self-4000
                   --fwd-configs "${AB_FWD:-4,1,1,0,0,3}" --bwd-configs "${AB_BWD:-4,1,1,0,0,2}")
[ -z "${AB_TABLES:-}" ] || gluon_block_sweep+=(--sweep-tables "$AB_TABLES")  # e.g. fp32: the one-program path
# gpu_tier NAME WORKERS TESTS SELECTION: the GPU tier of TESTS (pytest -k SELECTION) over WORKERS
# processes, its tail in gpu_tests_NAME.log; succeeds only if tests passed and none failed
gpu_tier() {
  python3 -m pytest -v -m gpu -n "$2" "$3" -k "$4" -p no:cacheprovider -rf 2>&1 | grep -v '^ *$\|Warning\|warner' \
    | tail -60 | tee "$OUT/gpu_tests_$1.log" && grep -q passed "$OUT/gpu_tests_$1.log" \
    && ! grep -q "failed\|error" "$OUT/gpu_tests_$1.log"
}
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
    checkpoint)
      # one multirun per batch size (its table: step time, MFU, HFU, peak memory per mode)
      for b in ${CKPT_BATCHES:-64 256}; do
        modes=$(echo "${CKPT_MODES:-none ops full}" | tr ' ' ,)
        # shellcheck disable=SC2086  # CKPT_OVERRIDES: several overrides
        python3 -m gemctl train -m --recipe small_h200 run.progress=false run.name=ckpt-b$b train.steps=30 \
          data.batch_size=$b data.eval_batch_size=64 parallel.activation_checkpoint.mode=$modes ${CKPT_OVERRIDES:-} \
          2>&1 | quiet | tee "$OUT/checkpoint_b$b.log"
        d=$(ls -d runs/ckpt-b$b/multirun-* | tail -1)
        cp "$d/sweep.md" "$OUT/checkpoint_b${b}_sweep.md"; cp "$d/sweep.json" "$OUT/checkpoint_b${b}_sweep.json"
      done ;;
    ab-gdpa)
      for impl in torch triton; do
        python3 -m gemctl train --recipe small_h200 run.progress=false model.kernels.gdpa=$impl run.name=small_h200-gdpa-$impl 2>&1 | quiet | tee "$OUT/small_h200_gdpa_$impl.log"
        cp "$(ls -d runs/small_h200-gdpa-$impl/* | tail -1)/summary.json" "$OUT/small_h200_gdpa_${impl}_summary.json"
      done ;;
    every)
      sel=${EVERY_K:-test_every or test_tma}  # whole test-name prefixes: bare words also match the node's path and keywords
      if python3 -c "import xdist" 2>/dev/null; then
        python3 -m pytest -q -m gpu -n 14 tests/test_{jagged_attention,block_attention,gdpa}_triton.py -k "$sel" \
          -p no:cacheprovider -p no:benchmark -rf 2>&1 | grep -v '^ *$\|Warning\|warner' | tail -30 | tee "$OUT/every.log"
      else
        for f in jagged_attention block_attention gdpa; do
          python3 -m pytest -q -m gpu "tests/test_${f}_triton.py" -k "$sel" -p no:cacheprovider -rf 2>&1 \
            | grep -v '^ *$' | tail -30 > "$OUT/every_$f.log" &
        done; wait; tail -n 6 "$OUT"/every_*.log
      fi ;;
    sweep-block) python3 scripts/bench_block_attention.py --sweep --out "$OUT/sweep_block.json" 2>&1 | quiet | tee "$OUT/sweep_block.log" ;;
    block-hopper)
      gpu_tier block_hopper 8 tests/test_block_attention_triton.py "hopper or every_candidate or deterministic" \
        && python3 scripts/bench_block_attention.py --sweep --fwd-configs "4,2,0,0,1 4,1,1,0,0,3 4,1,1,0,0,2" --bwd-configs "4,1,1,0,1 4,1,1,0,0,2 4,1,1,0,0,1" \
          --out "$OUT/sweep_block_hopper.json" 2>&1 | quiet | tee "$OUT/sweep_block_hopper.log" ;;
    gdpa-probes)
      python3 scripts/bench_gdpa.py --grid-only --only cross-128 --grid-configs 64,128,4,2,2,16,0,0,1,1 --probes \
        --out "$OUT/gdpa_probes.json" 2>&1 | quiet | tee "$OUT/gdpa_probes.log"
      python3 scripts/bench_gdpa.py --only self-1000 --ab 10 --out "$OUT/gdpa_self1000_ab.json" 2>&1 | quiet \
        | tee "$OUT/gdpa_self1000_ab.log" ;;
    gdpa-ws)
      # the warp-specialized GDPA forwards: their GPU tier first (each test stopped after 90 s: a
      # hung kernel must not take the call), then, only if that passed, cross-128 and cross-32 timed
      # against the resident Gluon pick and the Triton resident-key pick, and self-1000 (streaming)
      # against the Triton tile loop and the softmax forward
      GEMCTL_GPU_TEST_TIMEOUT=90 gpu_tier gdpa_ws 8 tests/test_gdpa_triton.py \
        "(hopper_forward_gpu or hopper_stream or every_candidate) and (_0_0_2_ or _0_0_0_3)" \
        && timeout 240 python3 scripts/bench_gdpa.py --grid-only --only cross-128 cross-32 --grid-configs \
          64,128,4,2,2,16,0,0,1,1 64,32,4,3,0,4 64,128,4,4,1,16,0,0,2,2 64,128,4,6,1,16,0,0,2,1 \
          64,128,4,4,1,8,0,0,2,2 64,64,4,6,1,16,0,0,2,2 64,32,4,8,1,16,0,0,2,2 \
          --out "$OUT/gdpa_ws_grid.json" 2>&1 | quiet | tee "$OUT/gdpa_ws_grid.log" \
        && timeout 180 python3 scripts/bench_gdpa.py --grid-only --only self-1000 --grid-configs \
          64,32,4,3,0,0 64,64,4,4,1,0,0,0,3 64,64,4,3,1,0,0,0,3 64,128,4,2,1,0,0,0,3 64,32,4,6,1,0,0,0,3 \
          --out "$OUT/gdpa_ws_stream_grid.json" 2>&1 | quiet | tee "$OUT/gdpa_ws_stream_grid.log" ;;
    bench-mx) python3 scripts/bench_mx.py --out "$OUT/bench_mx.json" 2>&1 | quiet | tee "$OUT/bench_mx.log" ;;
    tests-precision)
      # compile-bound (447 s in one process on 2026-11-30): with pytest-xdist (a wheel in .whl/) 12 workers
      par=""; python3 -c "import xdist" 2>/dev/null && par="-n 12"
      python3 -m pytest -v -m gpu $par tests/test_fp8.py tests/test_mx.py tests/test_mx_attention.py -p no:cacheprovider -rf 2>&1 \
        | grep -E "PASSED|FAILED|ERROR|passed|failed" | tee "$OUT/gpu_tests_precision.log" ;;
    bench-fp8) python3 scripts/bench_fp8.py --only cast,mlp --pending --out "$OUT/bench_fp8.json" 2>&1 | quiet | tee "$OUT/bench_fp8.log" ;;
    bench-fp8-issue)
      # issue 6's speed bars alone: the casts the fused MLP block runs at the widths of both
      # BENCHMARKS.md mlp shapes (--cast-set block: the RMSNorm and plain pairs at d, the SiLU and
      # plain pairs at 4d), then the block against compiled BF16 at d = 1024, 2048
      python3 scripts/bench_fp8.py --only cast,mlp --cast-set block --cast-widths 1024,4096,2048,8192 \
        --mlp "bf16 compiled,fp8 row fused+norm" --out "$OUT/bench_fp8_issue.json" 2>&1 | quiet | tee "$OUT/bench_fp8_issue.log" ;;
    bench-fp8-model)
      python3 scripts/bench_fp8.py --only cast --pending --cast-widths 768,3072 --tokens 89569 \
        --out "$OUT/bench_fp8_model_shapes.json" 2>&1 | quiet | tee "$OUT/bench_fp8_model_shapes.log" ;;
    tests-multi-gpu)
      python3 -m pytest -v -s -m gpu tests/test_parallel.py -k two_gpus -p no:cacheprovider -rf 2>&1 \
        | grep -E "PASSED|FAILED|ERROR|Error|passed|failed|skipped|relative loss" | tee "$OUT/gpu_tests_multi_gpu.log" ;;
    scaling)
      # plain batches, then Base Batch Shuffling (every rank's batch about the same work: the ranks
      # wait for the slowest at every collective, and GEM-like lengths make per-rank work uneven)
      ngpu=$(nvidia-smi -L | wc -l)
      for shuf in none bbs; do
        name=small_h200-fsdp$ngpu-$shuf
        python3 -m gemctl train --recipe small_h200 run.progress=false launcher=torchrun launcher.nproc_per_node=$ngpu \
          parallel=fsdp parallel.topology.gpus_per_node=$ngpu metrics.scaling_baseline_steps=20 shuffle=$shuf \
          shuffle.sub_batch_size=8 run.name=$name 2>&1 | quiet | tee "$OUT/$name.log"
        cp "$(ls -d runs/$name/* | tail -1)/summary.json" "$OUT/${name}_summary.json"
      done ;;
    sweep) python3 scripts/bench_jagged_attention.py --sweep fwd --sweep dkdv --sweep dq --out "$OUT/sweep_jagged.json" 2>&1 | quiet | tee "$OUT/sweep_jagged.log" ;;
    ncu)
      # one autotuned forward+backward each: jagged attention self-1000, GDPA cross-128, block attention self-1000
      for spec in "jagged:_jagged_attn:bench_jagged_attention.py --profile-step" \
                  "gdpa:_gdpa:bench_gdpa.py --profile-step cross-128" \
                  "block:_block_attn:bench_block_attention.py --profile-step self-1000"; do
        IFS=: read -r name regex cmd <<< "$spec"
        pins_var="NCU_PIN_${name^^}"  # e.g. NCU_PIN_GDPA="--pin gdpa_fwd=64,32,4,3,0,0": the benchmark's picks
        ncu --clock-control none --profile-from-start off --kernel-name "regex:$regex" \
          --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
          --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
          python3 scripts/$cmd ${!pins_var} > "$OUT/ncu_$name.txt" 2>&1
        grep -E "^profiled configs|^  $regex|Duration|Throughput|Registers Per|Achieved Occupancy|Issue Slots|Executed Ipc|Stall" \
          "$OUT/ncu_$name.txt" | head -40
      done ;;
    block-records)
      gpu_tier block_records 4 tests/test_block_attention_triton.py "every_candidate and 0_1_0_1" \
        && for round in 1 2; do
          python3 scripts/bench_block_attention.py --sweep --only self-1000 self-4000 --fwd-configs "4,2,0,0,1 4,2,0,0,1,0,1" \
            --bwd-configs "4,1,1,0,1 4,1,1,0,1,0,1" --out "$OUT/sweep_block_records_$round.json" 2>&1 | quiet \
            | tee "$OUT/sweep_block_records_$round.log"
        done ;;
    block-ab)
      ab_trees block "$OUT/ab_block" "${gluon_block_sweep[@]}"
      [ "${AB_TIER:-1}" = 0 ] || GEMCTL_GPU_TEST_TIMEOUT=120 gpu_tier block_ab 16 tests/test_block_attention_triton.py \
        "hopper_gpu or ignores_non_finite or (every_candidate and (0_0_2 or 0_0_3))" ;;
    proxy-check) proxy_check ;;
    block-partial)
      for round in 1 2; do
        "${sweep_py[@]}" "${gluon_block_sweep[@]}" --whole-blocks --out "$OUT/sweep_block_partial_$round.json" 2>&1 | quiet \
          | tee -a "$OUT/sweep_block_partial.log"
      done ;;
    cast-ab)
      # shellcheck disable=SC2046  # --pending: one word or none
      ab_trees cast "$OUT/ab_cast" scripts/bench_fp8.py --only cast --cast-widths "${AB_CAST_WIDTHS:-1024}" \
        $([ "${AB_PENDING:-0}" = 1 ] && echo --pending)
      [ "${AB_TIER:-1}" = 0 ] || gpu_tier cast_ab 8 tests/test_fp8.py "cast or norm or amax or warp" ;;
    gdpa-ab)
      # shellcheck disable=SC2086  # AB_GDPA: words, one config each
      ab_trees gdpa "$OUT/ab_gdpa" scripts/bench_gdpa.py --grid-only --only cross-128 cross-32 self-1000 \
        --grid-configs ${AB_GDPA:-64,128,4,4,1,16,0,0,2,2 64,128,4,2,2,16,0,0,1,1 64,64,4,4,1,0,0,0,3}
      [ "${AB_TIER:-1}" = 0 ] || GEMCTL_GPU_TEST_TIMEOUT=120 gpu_tier gdpa_ab 16 tests/test_gdpa_triton.py \
        "hopper_forward_gpu or hopper_stream or (every_candidate and (_0_0_1_ or _0_0_2_ or _0_0_0_3))" ;;
    ncu-sass)
      case "${NCU_SASS_TARGET:-gdpa}" in
        gdpa) regex=_gdpa_fwd; pin=gdpa_fwd; configs="64,128,4,2,2,16,0,0,1,1 64,128,4,2,2,16,0,0,1,1,2"
              target=(scripts/bench_gdpa.py --profile-step cross-128 --probes) ;;
        block) regex=_block_attn_bwd; pin=block_attention_bwd; configs="4,1,1,0,1 4,1,1,0,0,2"
               target=(scripts/bench_block_attention.py --profile-step self-1000) ;;
        *) echo "gpu.sh ncu-sass: NCU_SASS_TARGET is gdpa or block, got '$NCU_SASS_TARGET'" >&2; exit 2 ;;
      esac
      for cfg in ${NCU_SASS_CONFIGS:-$configs}; do
        tag=${NCU_SASS_TARGET:-gdpa}_$(echo "$cfg" | tr , _)
        if ! ncu --clock-control none --profile-from-start off --kernel-name "regex:$regex" --section SpeedOfLight \
            --section WarpStateStats --section SchedulerStats --section SourceCounters -o "$OUT/ncu_sass_$tag" -f \
            python3 "${target[@]}" --pin "$pin=$cfg" > "$OUT/ncu_sass_$tag.log" 2>&1; then
          echo "gpu.sh ncu-sass: ncu failed for $cfg (see ncu_sass_$tag.log)" >&2; tail -5 "$OUT/ncu_sass_$tag.log" >&2; continue
        fi
        { grep -E "^profiled configs" "$OUT/ncu_sass_$tag.log"
          ncu -i "$OUT/ncu_sass_$tag.ncu-rep" | grep -E "Duration|No Eligible|Eligible Warps|Warp Cycles Per Issued"
          ncu -i "$OUT/ncu_sass_$tag.ncu-rep" --page source --csv --print-source sass | python3 scripts/sass_stalls.py -
        } 2>&1 | tee "$OUT/sass_stalls_$tag.txt"
        rm -f "$OUT/ncu_sass_$tag.ncu-rep"
      done ;;
    precision-speed)
      # 40 untimed steps: at 30 steps (10 untimed) fp8_tower measured 431 ms against 381 at steady
      # state (H200, 2026-11-30). Each job's summary is copied out, so a job the call's limit cuts
      # does not take the finished ones with it.
      # shellcheck disable=SC2086  # PRECISION_OVERRIDES: words, one override each
      python3 -m gemctl train --recipe small_h200 -m precision="${PRECISION_RECIPES:-bf16,fp8_tower,fp8_mlp,fp8}" \
        ${PRECISION_OVERRIDES:-} run.progress=false train.steps=80 train.warmup_timing_steps=40 data.synthetic.num_items=100000 \
        data.synthetic.num_users=100000 run.output_dir=runs/precision-speed 2>&1 | quiet | tail -12 \
        | tee "$OUT/precision_speed.log"
      d=$(ls -d runs/precision-speed/small_h200/multirun-* | tail -1)
      for f in "$d"/*/summary.json; do cp "$f" "$OUT/precision_speed_job$(basename "$(dirname "$f")").json"; done
      cp "$d/sweep.json" "$OUT/precision_speed_sweep.json" 2>/dev/null ;;
    ablation-precision)
      # The NE ablation of the precision recipes (recipes/ablation_precision.yaml: small, 400 steps,
      # deterministic, 3 seeds), one multirun per dataset of ABLATION_DATA (default "movielens100k
      # synthetic"; MovieLens needs the recbole==1.2.1 wheel in .whl/) over ABLATION_RECIPES
      # (default bf16,fp8_mlp,mxfp8_safe; the first is the baseline), ABLATION_OVERRIDES
      # added to every job. Each multirun writes under a directory of this call's own (runs/ survives
      # between calls on a warm machine). As a dataset's jobs end, its tables (gemctl compare: every
      # job, then the recipes over their seeds; a recipe with no multirun named) go to ablation.md
      # and its sweeps and job summaries (per-step losses and gradient norms) to ablation_<data>.tgz,
      # so a call cut by its limit keeps the datasets that finished. The stage fails if a multirun did.
      # ABLATION_PARALLEL=1: one multirun per dataset and recipe, all started at once on the one GPU
      # (the deterministic kernels make each job's result independent of its neighbours; the step
      # times then measure nothing), each dataset reported once its own jobs end: the whole
      # ablation in one call (H200, 2026-12-06: 3-4 side by side took ~6 minutes; six take longer).
      abl_root=runs/ablation-$(date -u +%Y%m%d-%H%M%S)-$$ abl_rc=0
      abl_recipes=${ABLATION_RECIPES:-bf16,fp8_mlp,mxfp8_safe}
      abl_run() {  # DATA NAME PRECISIONS: one multirun
        # shellcheck disable=SC2086  # ABLATION_OVERRIDES: words, one override each
        python3 -m gemctl train --recipe ablation_precision -m precision="$3" train.seed=0,1,2 data="$1" \
          ${ABLATION_OVERRIDES:-} run.progress=false run.output_dir="$abl_root" run.name="$2" > "$OUT/$2.log" 2>&1
      }
      abl_report() {  # DATA NAME...: the dataset's tables and job summaries from the multiruns of NAME...
        local data=$1 name d cmp="$OUT/ablation_${data}_compare" rc=0; shift
        local -a dirs=() missing=()
        for name in "$@"; do
          d=$(ls -d "$abl_root/$name"/multirun-* 2>/dev/null | tail -1)
          if [ -n "$d" ]; then dirs+=("$d"); else missing+=("$name"); fi
        done
        {
          echo "## data=$data ${ABLATION_OVERRIDES:-}"; echo
          [ "${ABLATION_PARALLEL:-0}" = 1 ] && echo "(multiruns side by side: step ms and speed-up measure nothing)" && echo
          for name in "${missing[@]}"; do echo "(no multirun: $name; its log: $name.log)"; done
          # the first recipe as the baseline; where ABLATION_OVERRIDES sweeps too, it names several
          # settings, and the first job's setting is the baseline instead
          if [ "${#dirs[@]}" -gt 0 ] && { python3 -m gemctl compare "${dirs[@]}" --baseline "precision=${abl_recipes%%,*}" \
                 --out "$cmp.json" > "$cmp.md" 2>&1 || python3 -m gemctl compare "${dirs[@]}" --out "$cmp.json" > "$cmp.md" 2>&1; }; then
            grep -v "^comparison: \|^compare: " "$cmp.md"
          else
            echo "(no comparison: see ablation_${data}_compare.md)"; rc=1
          fi
          echo
        } > "$cmp.section"  # not a pipe: rc must survive the group
        tee -a "$OUT/ablation.md" < "$cmp.section" && rm -f "$cmp.section"
        [ "${#missing[@]}" = 0 ] || rc=1
        # shellcheck disable=SC2046  # each multirun's sweep and job summaries
        [ "${#dirs[@]}" = 0 ] || tar -czf "$OUT/ablation_$data.tgz" \
          $(for d in "${dirs[@]}"; do echo "$d/sweep.json" "$d"/*/summary.json; done) 2>/dev/null
        [ "$rc" = 0 ]
      }
      declare -A abl_pids=()
      for data in ${ABLATION_DATA:-movielens100k synthetic}; do
        if [ "${ABLATION_PARALLEL:-0}" = 1 ]; then
          for recipe in ${abl_recipes//,/ }; do
            abl_run "$data" "ablation_precision-$data-$recipe" "$recipe" &
            abl_pids[$data]+="$! "  # saved as started: a job that ends before the next starts leaves `jobs`
          done
        else
          abl_run "$data" "ablation_precision-$data" "$abl_recipes" || abl_rc=1
          abl_report "$data" "ablation_precision-$data" || abl_rc=1
        fi
      done
      if [ "${ABLATION_PARALLEL:-0}" = 1 ]; then
        for data in ${ABLATION_DATA:-movielens100k synthetic}; do
          for pid in ${abl_pids[$data]}; do wait "$pid" || abl_rc=1; done
          # shellcheck disable=SC2046  # one multirun name per recipe
          abl_report "$data" $(for recipe in ${abl_recipes//,/ }; do echo "ablation_precision-$data-$recipe"; done) || abl_rc=1
        done
      fi
      [ "$abl_rc" = 0 ] ;;
    profile)
      python3 -m gemctl profile --recipe small_h200 2>&1 | quiet | tee "$OUT/profile.log"
      d=$(ls -d runs/small_h200-profile/* | tail -1)
      cp "$d/profile.json" "$d/breakdown.png" "$d/waterfall.png" "$OUT/" ;;
    profile-multi-gpu)
      ngpu=$(nvidia-smi -L | wc -l)
      python3 -m gemctl profile --recipe small_h200 launcher=torchrun launcher.nproc_per_node=$ngpu parallel=fsdp \
        parallel.topology.gpus_per_node=$ngpu run.name=small_h200-fsdp$ngpu 2>&1 | quiet | tee "$OUT/profile_fsdp$ngpu.log"
      d=$(ls -d runs/small_h200-fsdp$ngpu-profile/* | tail -1)
      cp "$d/profile.json" "$OUT/profile_fsdp$ngpu.json"; cp "$d/breakdown.png" "$OUT/breakdown_fsdp$ngpu.png" ;;
    *) echo "gpu.sh: unknown stage '$stage' (tests, baseline, bench, bench-gdpa, bench-block, ab-gdpa, every, sweep, sweep-block, block-hopper, block-records, block-ab, block-partial, proxy-check, cast-ab, gdpa-ab, gdpa-probes, gdpa-ws, bench-mx, tests-precision, bench-fp8, bench-fp8-issue, bench-fp8-model, ncu, ncu-sass, precision-speed, ablation-precision, profile, tests-multi-gpu, scaling, profile-multi-gpu)" >&2; exit 2 ;;
  esac
done
