"""Jagged attention forward with the relative-position bias: per-element gathers (_BIAS_TILES False)
against plain bias tiles (True), same pinned configs, self-attention workloads, CUDA-graph time;
outputs compared bit for bit on the GPU. Run from the repository root with PYTHONPATH=.:scripts and
OUT set (the run of 2026-12-01 had the same code with a few long lines)."""
import sys, json, os, torch
sys.path.insert(0, "scripts")
from bench_common import graph_bench
from bench_jagged_attention import make_inputs
from gemctl import ops
from gemctl.ops.triton import common
from gemctl.ops.triton import jagged_attention as ja
from workloads import attention_workloads

rows = []
by_name = {w.name: w for w in attention_workloads(False)}
cfgs = [(64, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3, 1)]
for name, causal in (("self-1000", True), ("self-1000", False), ("self-500", True), ("self-200", True)):
    w = by_name[name]
    q, k, v, qo, ko, _, _, grad = make_inputs(w)
    mq = int(w.q_lengths.max())
    bias = ops.RelativePositionBias(torch.randn(w.heads, 32, device="cuda"), 1024)
    qd, kd, vd, scale = q.detach(), k.detach(), v.detach(), w.head_dim ** -0.5
    # causal flops: the visible pairs only
    L = w.q_lengths.double()
    pairs = float((L * (L + 1) / 2).sum()) if causal else float((L * L).sum())
    flops = 4 * pairs * w.heads * w.head_dim
    for cfg in cfgs:
        res = {}
        for tiles in (False, True):
            ja._BIAS_TILES = tiles
            with common.forced_config({"fwd": cfg}):
                out = ja._forward(qd, kd, vd, qo, ko, mq, mq, bias, causal, scale, 0)[0]
                def fwd():
                    return ja._forward(qd, kd, vd, qo, ko, mq, mq, bias, causal, scale, 0)
                ms = graph_bench(fwd, nan_on_failure=True)
            res[tiles] = (out, ms)
        same = torch.equal(res[False][0], res[True][0])
        row = {"workload": name, "causal": causal, "cfg": list(cfg), "gather_ms": res[False][1],
               "tiles_ms": res[True][1], "gather_tflops": flops / res[False][1] / 1e9,
               "tiles_tflops": flops / res[True][1] / 1e9, "bit_equal": same}
        rows.append(row)
        print(f"{name} causal={int(causal)} {str(cfg):18s} gather {row['gather_ms'] * 1e3:7.1f} us "
              f"{row['gather_tflops']:5.0f} TF/s | tiles {row['tiles_ms'] * 1e3:7.1f} us "
              f"{row['tiles_tflops']:5.0f} TF/s | bit-equal {same}", flush=True)
out_path = os.environ["OUT"] + "/bias_tiles_" + os.environ.get("GEMCTL_COMMIT", "x") + ".json"
json.dump(rows, open(out_path, "w"), indent=1)
