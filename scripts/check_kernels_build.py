"""Compile every bundled Triton kernel for Hopper (sm_90) without a GPU.

    python scripts/check_kernels_build.py [--arch 90]

A cheap CI check that the kernels still build for the GPU they are tuned for (the CPU tier runs
them under the interpreter, which accepts code the real compiler rejects). Must run without
TRITON_INTERPRET=1. Prints one line per kernel with its shared-memory use.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _signature(fn, types: dict, consts: dict) -> dict:
    return {name: "constexpr" if name in consts else types.get(name, "i32") for name in fn.arg_names}


def kernels():
    from gemctl.ops.triton import gdpa
    from gemctl.ops.triton import jagged_attention as ja

    io = {n: "*bf16" for n in ("Q", "K", "V", "O", "DO", "DK", "DV", "DQ")}
    io.update(LSE="*fp32", DELTA="*fp32", DBIAS="*fp32", BIAS="*fp32", BUCKETS="*i32", Q_OFFSETS="*i64",
              K_OFFSETS="*i64", WORK="*i32", qk_scale="fp32", scale="fp32")
    for causal in (False, True):
        for has_bias in (False, True):
            consts = dict(HEAD_DIM=128, BLOCK_M=64, BLOCK_N=64, CAUSAL=causal, HAS_BIAS=has_bias)
            yield ja._jagged_attn_fwd, io, consts
            yield ja._jagged_attn_bwd_dkdv, io, consts
            yield ja._jagged_attn_bwd_dq, io, dict(consts, NUM_BUCKETS=32)
    for act in (0, 1):  # gelu, silu
        for chunk in (0, 4):  # tile loop, resident short side
            consts = dict(HEAD_DIM=128, BLOCK_M=64, BLOCK_N=64, ACT=act, CHUNK=chunk)
            yield gdpa._gdpa_fwd, io, consts
            yield gdpa._gdpa_bwd_dkdv, io, consts
            yield gdpa._gdpa_bwd_dq, io, consts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("check_kernels_build: unset TRITON_INTERPRET (the interpreter compiles nothing)", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", args.arch, 32)
    for fn, types, consts in kernels():
        t0 = time.time()
        src = ASTSource(fn=fn, signature=_signature(fn, types, consts), constexprs=consts)
        compiled = triton.compile(src, target=target, options={"num_warps": 4, "num_stages": 3})
        flags = ",".join(f"{k}={int(v)}" for k, v in consts.items() if k in ("CAUSAL", "HAS_BIAS", "ACT"))
        print(f"{fn.__name__:<24} {flags:<18} sm_{args.arch}: ok ({time.time() - t0:.1f} s, {compiled.metadata.shared} B shared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
