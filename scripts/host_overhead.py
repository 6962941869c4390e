"""Host (CPU) time of one attention call, forward and forward+backward, with where it goes.

    python scripts/host_overhead.py [--op gdpa|jagged_attention] [--workload pma-32] [--top 20]

Measures the Python-side cost a training step pays per call (custom-op dispatch, planning, Triton
launches), which decides whether short kernels keep the GPU busy: wall time of issuing calls in a
loop (the GPU is ahead: inputs are small) and a cProfile of the same loop.
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
    ap.add_argument("--op", default="gdpa", choices=["gdpa", "jagged_attention"])
    ap.add_argument("--workload", default="pma-32", choices=list(WORKLOADS))
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    w = WORKLOADS[args.workload]()
    q, k, v, qo, ko, _, _, grad = make_inputs(w)
    mq, mk = int(w.q_lengths.max()), int(w.k_lengths.max())
    op = getattr(ops, args.op)

    def fwd():
        return op(q, k, v, qo, ko, mq, mk, backend="triton")

    def fwd_bwd():
        torch.autograd.backward(fwd(), grad)

    for name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        host = (time.perf_counter() - t0) / args.calls
        torch.cuda.synchronize()
        gpu_and_host = (time.perf_counter() - t0) / args.calls
        print(f"{args.op} {args.workload} {name}: host {host * 1e6:.0f} us/call, host+GPU {gpu_and_host * 1e6:.0f} us/call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        fwd_bwd()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
