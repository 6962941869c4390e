"""Per-kernel GPU time of the jagged attention backward (delta, dK/dV, dQ, the host-side bias reduction) without
bias, with gathers and with bias tiles, autotuned configs, from torch.profiler (20 calls each)."""
import sys, json, os, torch, collections
sys.path.insert(0, "scripts")
from bench_jagged_attention import make_inputs
from gemctl import ops
from gemctl.ops.triton import jagged_attention as ja
from workloads import attention_workloads

by_name = {w.name: w for w in attention_workloads(False)}
rows = []
for name, causal in (("self-1000", True), ("self-200", True)):
    w = by_name[name]
    q, k, v, qo, ko, _, _, grad = make_inputs(w)
    mq = int(w.q_lengths.max())
    bias = ops.RelativePositionBias(torch.randn(w.heads, 32, device="cuda"), 1024)
    qd, kd, vd, scale = q.detach(), k.detach(), v.detach(), w.head_dim ** -0.5
    for tag, b, tiles in (("nobias", None, False), ("gathers", bias, False), ("tiles", bias, True)):
        ja._BIAS_TILES_BWD = tiles
        out, lse, _ = ja._forward(qd, kd, vd, qo, qo, mq, mq, b, causal, scale, 0)
        fn = lambda: ja._backward(grad, qd, kd, vd, out, lse, qo, qo, mq, mq, b, causal, scale, 0)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        per = collections.defaultdict(float)
        for e in prof.key_averages():
            if e.device_time_total > 0:
                per[e.key[:60]] += e.device_time_total / 20
        top = sorted(per.items(), key=lambda kv: -kv[1])
        print(f"{name} causal={int(causal)} {tag}: total {sum(per.values()):.1f} us", flush=True)
        for kname, us in top[:8]:
            print(f"   {us:8.1f} us  {kname}", flush=True)
        rows.append({"workload": name, "causal": causal, "tag": tag, "per_kernel_us": dict(top)})
json.dump(rows, open(os.environ["OUT"] + "/bwd_breakdown_" + os.environ.get("GEMCTL_COMMIT", "x") + ".json", "w"), indent=1)
