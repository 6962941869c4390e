"""Jagged attention backward with the relative-position bias: per-element gathers (_BIAS_TILES_BWD False)
against plain bias tiles (True), each autotuned over every dK/dV and dQ candidate (the autotune key keys the
two apart), self-attention workloads, CUDA-graph time; dq, dk, dv and the bias table's gradient compared bit for
bit on the GPU (same pinned configs), and the no-bias backward timed alongside."""
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
for name, causal in (("self-1000", True), ("self-1000", False), ("self-500", True), ("self-200", True)):
    w = by_name[name]
    q, k, v, qo, ko, _, _, grad = make_inputs(w)
    mq = int(w.q_lengths.max())
    bias = ops.RelativePositionBias(torch.randn(w.heads, 32, device="cuda"), 1024)
    qd, kd, vd, scale = q.detach(), k.detach(), v.detach(), w.head_dim ** -0.5
    L = w.q_lengths.double()
    pairs = float((L * (L + 1) / 2).sum()) if causal else float((L * L).sum())
    flops = 10 * pairs * w.heads * w.head_dim  # backward: 5 matmuls of 2 flops per pair and dim
    res = {}
    for tag, b, tiles in (("nobias", None, False), ("gathers", bias, False), ("tiles", bias, True)):
        ja._BIAS_TILES_BWD = ja._DBIAS_DIAG = tiles  # "gathers": as before (masked sums per bucket)
        out, lse, _ = ja._forward(qd, kd, vd, qo, qo, mq, mq, b, causal, scale, 0)
        fn = lambda: ja._backward(grad, qd, kd, vd, out, lse, qo, qo, mq, mq, b, causal, scale, 0)
        fn()  # autotunes outside the graph
        ms = graph_bench(fn, nan_on_failure=True)
        res[tag] = ms
        print(f"{name} causal={int(causal)} {tag:8s} {ms*1e3:8.1f} us {flops/ms/1e9:6.0f} TF/s", flush=True)
    # bits: the same configs for both paths
    same = {}
    for cfg_dkdv, cfg_dq in (((64, 64, 4, 2, 0), (64, 64, 4, 2)), ((64, 64, 4, 2, 1), (128, 64, 8, 2))):
        outs = {}
        for tiles in (False, True):
            ja._BIAS_TILES_BWD = tiles
            ja._DBIAS_DIAG = True
            out, lse, _ = ja._forward(qd, kd, vd, qo, qo, mq, mq, bias, causal, scale, 0)
            with common.forced_config({"dkdv": cfg_dkdv, "dq": cfg_dq}):
                outs[tiles] = ja._backward(grad, qd, kd, vd, out, lse, qo, qo, mq, mq, bias, causal, scale, 0)
        same[str((cfg_dkdv, cfg_dq))] = [bool(torch.equal(a, b)) for a, b in zip(outs[False], outs[True])]
    print(f"   bit-equal (dq, dk, dv, dtable): {same}", flush=True)
    rows.append({"workload": name, "causal": causal, "nobias_ms": res["nobias"], "gathers_ms": res["gathers"],
                 "tiles_ms": res["tiles"], "speedup": res["gathers"] / res["tiles"], "bit_equal": same})
    print(f"   tiles vs gathers {res['gathers']/res['tiles']:.2f}x; bias cost gathers {res['gathers']/res['nobias']:.2f}x,"
          f" tiles {res['tiles']/res['nobias']:.2f}x", flush=True)
json.dump(rows, open(os.environ["OUT"] + "/bias_tiles_bwd_" + os.environ.get("GEMCTL_COMMIT", "x") + ".json", "w"),
          indent=1)
