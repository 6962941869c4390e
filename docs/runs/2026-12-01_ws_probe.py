"""Minimal GDPA-like forward (q tile 64 x 128 over 128 keys in 32-key tiles via TMA, polynomial GELU) with and
without tl.range(warp_specialize=True), on the GPU: correctness against torch and time.
Usage: python3 2026-12-01_ws_probe.py WS WARPS STAGES (e.g. 1 4 2). The run's log (.log beside this file) also
printed a bandwidth column with a wrong unit; that print is gone, nothing else changed."""
import sys, time, torch, triton, triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

@triton.jit
def k_min(Q_DESC, K_DESC, V_DESC, O_DESC, n_keys, n_samples, scale, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
          WS: tl.constexpr):
    pid = tl.program_id(0)
    q = Q_DESC.load([pid * BM, 0])
    kbase = (pid % n_samples) * n_keys
    acc = tl.zeros([BM, D], dtype=tl.float32)
    for n in tl.range(0, n_keys, BN, warp_specialize=WS):
        k = K_DESC.load([kbase + n, 0])
        v = V_DESC.load([kbase + n, 0])
        s = tl.dot(q, k.T) * scale
        t = tl.minimum(s * s, 16.0)
        p = 0.5 * (s + t * (0.79 + t * (-0.13 + t * 0.0175)))
        acc = tl.dot(p.to(tl.bfloat16), v, acc)
    O_DESC.store([pid * BM, 0], acc.to(tl.bfloat16))

def alloc(size, align, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")

def main():
    ws, warps, stages = bool(int(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3])
    triton.set_allocator(alloc)
    BM, BN, D, NK, NS = 64, 32, 128, 128, 1024
    tiles = 6144
    q = torch.randn(tiles * BM, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(NS * NK, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(NS * NK, D, device="cuda", dtype=torch.bfloat16)
    o = torch.empty_like(q)
    scale = D ** -0.5
    descs = [TensorDescriptor.from_tensor(t, [b, D]) for t, b in ((q, BM), (k, BN), (v, BN), (o, BM))]
    run = lambda: k_min[(tiles,)](*descs, NK, NS, scale, BM=BM, BN=BN, D=D, WS=ws, num_warps=warps, num_stages=stages)
    run(); torch.cuda.synchronize()
    # reference for a few tiles
    for t in (0, 1, 1500, tiles - 1):
        qs = q[t * BM:(t + 1) * BM].float(); kb = (t % NS) * NK
        s = qs @ k[kb:kb + NK].float().T * scale
        tt = torch.clamp(s * s, max=16.0)
        p = 0.5 * (s + tt * (0.79 + tt * (-0.13 + tt * 0.0175)))
        ref = p.bfloat16().float() @ v[kb:kb + NK].float()
        err = (o[t * BM:(t + 1) * BM].float() - ref).abs().max().item() / ref.abs().max().item()
        assert err < 2e-2, (t, err)
    ms = triton.testing.do_bench_cudagraph(run, rep=200)
    flops = 4 * tiles * BM * NK * D
    print(f"WS={int(ws)} warps={warps} stages={stages}: {ms * 1e3:.1f} us, {flops / ms / 1e9:.0f} TF/s", flush=True)

main()
