"""The dQ pass with the bias (its bias-gradient reduction): masked sums per bucket (DIAG 0), diagonal sums by a
register gather (1) or through a global scratch tile (2); the bias by gathers or as tiles; pinned dQ configs;
per-kernel GPU time from torch.profiler (20 calls). dq, dk, dv must be bit-identical across DIAG; the bias
gradient close (summation order differs)."""
import sys, json, os, torch, collections
sys.path.insert(0, "scripts")
from bench_jagged_attention import make_inputs
from gemctl import ops
from gemctl.ops.triton import common
from gemctl.ops.triton import jagged_attention as ja
from workloads import attention_workloads

def kernel_us(fn, n=20):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    for e in prof.key_averages():
        if e.device_time_total > 0:
            per[e.key] += e.device_time_total / n
    return per

by_name = {w.name: w for w in attention_workloads(False)}
rows = []
for name, causal in (("self-1000", True), ("self-1000", False), ("self-200", True)):
    w = by_name[name]
    q, k, v, qo, ko, _, _, grad = make_inputs(w)
    mq = int(w.q_lengths.max())
    bias = ops.RelativePositionBias(torch.randn(w.heads, 32, device="cuda"), 1024)
    qd, kd, vd, scale = q.detach(), k.detach(), v.detach(), w.head_dim ** -0.5
    out, lse, _ = ja._forward(qd, kd, vd, qo, qo, mq, mq, bias, causal, scale, 0)
    for dq_cfg in ((64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3)):
        pins = {"dkdv": (64, 64, 4, 2, 0), "dq": dq_cfg}
        with common.forced_config(pins):
            ja._BIAS_TILES_BWD = False
            nob = kernel_us(lambda: ja._backward(grad, qd, kd, vd, out, lse, qo, qo, mq, mq, None, causal, scale, 0))
            ref = None
            line = f"{name} causal={int(causal)} dq {dq_cfg}: no bias {nob['_jagged_attn_bwd_dq']:7.1f} us |"
            for tiles in ("", "dq"):
                for diag in (0, 1, 2):
                    ja._BIAS_TILES_BWD, ja._DBIAS_DIAG = tiles, diag
                    fn = lambda: ja._backward(grad, qd, kd, vd, out, lse, qo, qo, mq, mq, bias, causal, scale, 0)
                    res = fn()
                    if ref is None:
                        ref = res
                    same = all(torch.equal(a, b) for a, b in zip(res[:3], ref[:3]))
                    close = torch.allclose(res[3], ref[3], rtol=1e-3, atol=1e-3 * ref[3].abs().max().item())
                    us = kernel_us(fn)["_jagged_attn_bwd_dq"]
                    line += f" {'T' if tiles else 'G'}{diag} {us:7.1f}{'' if same and close else ' MISMATCH'}"
                    rows.append({"workload": name, "causal": causal, "dq_cfg": dq_cfg, "tiles": bool(tiles), "diag": diag,
                                 "dq_us": us, "nobias_dq_us": nob["_jagged_attn_bwd_dq"], "grads_equal": same,
                                 "dtable_close": close,
                                 "dtable_maxdiff": (res[3] - ref[3]).abs().max().item()})
            print(line, flush=True)
json.dump(rows, open(os.environ["OUT"] + "/dbias_diag_" + os.environ.get("GEMCTL_COMMIT", "x") + ".json", "w"), indent=1)
