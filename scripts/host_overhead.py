"""Host (CPU) time of one attention call or FP8 MLP block, forward and forward+backward, with
where it goes.

    python scripts/host_overhead.py [--op gdpa|jagged_attention|fp8_mlp] [--workload pma-32] [--top 20]
    python scripts/host_overhead.py --op fp8_mlp --stub-launches      # on a CPU machine too

Measures the Python-side cost a training step pays per call (custom-op dispatch, planning, Triton
launches), which decides whether short kernels keep the GPU busy: wall time of issuing calls in a
loop (the GPU is ahead: inputs are small) and a cProfile of the same loop. ``--stub-launches``
(fp8_mlp) replaces every Triton launch by a no-op and forces the kernel path on CPU tensors with
autotuning off: gemctl's own host cost per block (casts' and GEMMs' wrappers, autograd), without
Triton's launcher or a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_jagged_attention import make_inputs  # noqa: E402
from gemctl import ops  # noqa: E402
from workloads import cross_workload, pma_workload, self_workload  # noqa: E402

WORKLOADS = {"pma-32": lambda: pma_workload(256, 32), "cross-32": lambda: cross_workload(256, 32),
             "cross-128": lambda: cross_workload(256, 128), "self-1000": lambda: self_workload(256, 1000)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="gdpa", choices=["gdpa", "jagged_attention", "fp8_mlp"])
    ap.add_argument("--stub-launches", action="store_true", help="fp8_mlp: Triton launches as no-ops, CPU tensors")
    ap.add_argument("--workload", default="pma-32", choices=list(WORKLOADS))
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    if args.op == "fp8_mlp":
        fwd, grad = fp8_mlp_call(args.stub_launches)
    else:
        w = WORKLOADS[args.workload]()
        q, k, v, qo, ko, _, _, grad = make_inputs(w)
        mq, mk = int(w.q_lengths.max()), int(w.k_lengths.max())
        op = getattr(ops, args.op)

        def fwd():
            return op(q, k, v, qo, ko, mq, mk, backend="triton")

    def fwd_bwd():
        torch.autograd.backward(fwd(), grad)

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    what = "fp8_mlp (launches stubbed)" if args.stub_launches else f"{args.op} {args.workload}"
    for name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        host = (time.perf_counter() - t0) / args.calls
        sync()
        gpu_and_host = (time.perf_counter() - t0) / args.calls
        print(f"{what} {name}: host {host * 1e6:.0f} us/call, host+GPU {gpu_and_host * 1e6:.0f} us/call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        fwd_bwd()
    prof.disable()
    sync()
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


def fp8_mlp_call(stub: bool):
    """The model's FP8 MLP block (RMSNorm fused, row-wise, FP8 weight gradients) at d=1024 on CUDA,
    or with ``stub`` on small CPU tensors whose kernels are not run (the host path is the same
    whatever the sizes: one launch per cast and GEMM)."""
    from gemctl.precision import fp8_linear
    from gemctl.precision.fp8_linear import Fp8Recipe, fp8_mlp

    if stub:
        import os

        from triton.runtime.jit import JITFunction

        from gemctl.ops.triton import common

        os.environ["GEMCTL_AUTOTUNE"] = "0"  # the first candidate; timing needs a GPU
        JITFunction.run = lambda self, *a, **k: None
        fp8_linear.triton_ready = lambda *t: True
        common._sm_count = lambda device: 132
        tokens, d, h, device = 256, 64, 256, "cpu"
    else:
        tokens, d, h, device = 65536, 1024, 4096, "cuda"
    bf16 = torch.bfloat16
    up = (torch.randn(h, d, device=device) / d**0.5).to(bf16).requires_grad_(True)
    down = (torch.randn(d, h, device=device) / h**0.5).to(bf16).requires_grad_(True)
    norm_w = torch.ones(d, device=device, dtype=bf16, requires_grad=True)
    x = torch.randn(tokens, d, device=device, dtype=bf16, requires_grad=True)

    def fwd():
        for t in (x, up, down, norm_w):
            t.grad = None
        return fp8_mlp(x, up, down, Fp8Recipe(), norm_weight=norm_w, eps=1e-6)

    return fwd, torch.randn(tokens, d, device=device, dtype=bf16)


if __name__ == "__main__":
    main()
