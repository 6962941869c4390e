"""Compile every bundled Triton kernel for Hopper (sm_90) without a GPU.

    python scripts/check_kernels_build.py [--arch 90]
    python scripts/check_kernels_build.py --ptxas 4,1      # registers, spills, programs per SM instead
    python scripts/check_kernels_build.py --ptxas 4,2 --head-loop   # block attention with its head loop

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


def _with_defaults(fn, consts: dict) -> dict:
    """``consts`` plus the kernel's constexpr parameters left at their defaults (compiled with them)."""
    return {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts}


def kernels():
    from gemctl.ops.triton import block_attention as ba
    from gemctl.ops.triton import fp8_gemm as f8
    from gemctl.ops.triton import gdpa
    from gemctl.ops.triton import jagged_attention as ja
    from gemctl.ops.triton import mx_quant as mx
    from gemctl.ops.triton import rms_norm

    io = {n: "*bf16" for n in ("Q", "K", "V", "O", "DO", "DK", "DV", "DQ")}
    io.update(LSE="*fp32", DELTA="*fp32", DBIAS="*fp32", BIAS="*fp32", BUCKETS="*i32", Q_OFFSETS="*i64",
              K_OFFSETS="*i64", WORK="*i32", qk_scale="fp32", scale="fp32")
    io.update(COS="*fp16", SIN="*fp16", OFFSETS="*i64", MROW="*fp32")  # rope_table_dtype(bf16)
    for causal in (False, True):
        for has_bias in (False, True):
            consts = dict(HEAD_DIM=128, BLOCK_M=64, BLOCK_N=64, CAUSAL=causal, HAS_BIAS=has_bias)
            yield ja._jagged_attn_fwd, io, dict(consts, WINDOWED=False)
            for transposed in (False, True):
                yield ja._jagged_attn_bwd_dkdv, io, dict(consts, TRANSPOSED=transposed)
            yield ja._jagged_attn_bwd_dq, io, dict(consts, NUM_BUCKETS=32)
    yield ja._jagged_attn_fwd, io, dict(HEAD_DIM=128, BLOCK_M=64, BLOCK_N=64, CAUSAL=True, HAS_BIAS=True, WINDOWED=True)
    # self-attention's bias read as plain tiles (bias_tile_table), the model's case; the backward's
    # passes too (dK/dV straight and transposed, dQ)
    tiled = dict(HEAD_DIM=128, BLOCK_M=64, BLOCK_N=32, CAUSAL=True, HAS_BIAS=2)
    yield ja._jagged_attn_fwd, io, dict(tiled, WINDOWED=False)
    yield ja._jagged_attn_bwd_dkdv, io, dict(tiled, TRANSPOSED=False)
    yield ja._jagged_attn_bwd_dkdv, io, dict(tiled, BLOCK_M=32, BLOCK_N=64, TRANSPOSED=True)  # as its candidates
    yield ja._jagged_attn_bwd_dq, io, dict(tiled, NUM_BUCKETS=32)
    yield ja._bwd_delta, io, dict(HEAD_DIM=128, BLOCK_R=ja._DELTA_ROWS)  # the backward's rowsum(dO * O)
    tiles = {name: "tensordesc<bf16[64, 128]>" for name in ("K_DESC", "V_DESC", "Q_DESC", "DO_DESC")}
    for causal in (False, True):  # the unmasked tiles by TMA
        consts = dict(HEAD_DIM=128, BLOCK_M=64, BLOCK_N=64, CAUSAL=causal, HAS_BIAS=causal, TMA=True)
        yield ja._jagged_attn_fwd, dict(io, **tiles), dict(consts, WINDOWED=False, LAZY=not causal)  # + lazy rescaling
        if causal:  # the model's forward: causal, the bias as tiles, the unmasked tiles by TMA
            yield ja._jagged_attn_fwd, dict(io, **tiles), dict(consts, WINDOWED=False, HAS_BIAS=2)
        yield ja._jagged_attn_bwd_dkdv, dict(io, **tiles), dict(consts, TRANSPOSED=causal)
        if causal:
            yield ja._jagged_attn_bwd_dq, dict(io, **tiles), dict(consts, NUM_BUCKETS=32)
    mx_p = dict(HEAD_DIM=128, BLOCK_M=64, BLOCK_N=64, CAUSAL=True, HAS_BIAS=True, MX_P=2)  # MXFP8 probabilities
    yield ja._jagged_attn_fwd, io, dict(mx_p, WINDOWED=False)
    for transposed in (False, True):
        yield ja._jagged_attn_bwd_dkdv, io, dict(mx_p, TRANSPOSED=transposed)
    for act in (0, 1):  # gelu, silu
        for chunk in (0, 4):  # tile loop, resident short side
            consts = dict(HEAD_DIM=128, BLOCK_M=64, BLOCK_N=64, ACT=act, CHUNK=chunk)
            yield gdpa._gdpa_fwd, io, dict(consts, FOLD=act == 0)  # GELU: the scale in its constants
            yield gdpa._gdpa_bwd_dkdv, io, dict(consts, FOLD=act == 0)
            yield gdpa._gdpa_bwd_dq, io, dict(consts, FOLD=act == 0)
    kv_tiles = {name: "tensordesc<bf16[32, 128]>" for name in ("K_DESC", "V_DESC")}  # whole key tiles by TMA
    yield gdpa._gdpa_fwd, dict(io, **kv_tiles), dict(HEAD_DIM=128, BLOCK_M=64, BLOCK_N=32, ACT=0, CHUNK=0, TMA=True,
                                                                 FOLD=True)
    mx_io = dict(X="*i16", W="*bf16", Y="*bf16", DATA="*u8", SCALE="*u8", eps="fp32")  # bf16 input as int16
    for e5m2, emax, elem_max in ((False, 8, 448.0), (True, 15, 57344.0)):  # E4M3, E5M2 elements
        for rceil in (False, True):
            consts = dict(EMAX=emax, ELEM_MAX=elem_max, E5M2=e5m2, RCEIL=rceil, BIT_CAST=False, IN_BF16=True, BLOCK=32)
            yield mx._mx_quant_kernel, mx_io, dict(consts, BLOCK_R=32, BLOCKS_C=4)
            yield mx._mx_quant_axis0_kernel, mx_io, dict(consts, BLOCK_C=1024, CHUNK=8)
    e4m3 = dict(EMAX=8, ELEM_MAX=448.0, E5M2=False, RCEIL=True, IN_BF16=True, BLOCK=32)
    yield mx._mx_quant_kernel, mx_io, dict(e4m3, BIT_CAST=True, BLOCK_R=32, BLOCKS_C=4)  # integer rounding path
    yield mx._mx_quant_axis0_kernel, mx_io, dict(e4m3, BIT_CAST=True, BLOCK_C=1024, CHUNK=8)
    for write_y in (False, True):  # d_model 2048 (BENCHMARKS.md mlp): 64 MX blocks per row
        yield mx._rmsnorm_mx_quant_kernel, mx_io, dict(e4m3, BIT_CAST=False, WRITE_Y=write_y, HAS_W=True,
                                                       BLOCK_R=4, BLOCKS_C=64)
    f8_io = dict(A="*fp8e4nv", B="*fp8e4nv", C="*bf16", SA="*u8", SB="*u8", PRE="*bf16", X="*i16", DATA="*u8",
                 SCALE="*u8", DATA_T="*u8", PART="*u8", NW="*fp32", RSTD="*fp32", eps="fp32")
    for group, chunk, epi in ((0, 0, 0), (0, 0, 2), (0, 4096, 0), (4096, 4096, 0), (128, 0, 0), (32, 0, 0)):
        yield f8._fp8_gemm_kernel, f8_io, dict(GROUP_K=group, CHUNK_K=chunk, EPI=epi, BLOCK_M=128, BLOCK_N=128,
                                               BLOCK_K=group if group in (32, 128) else 128, GROUP_M=8)
    gemm_tiles = dict(f8_io, a_desc="tensordesc<fp8e4nv[128, 128]>", b_desc="tensordesc<fp8e4nv[128, 128]>")
    for group, epi in ((0, 2), (4096, 0)):  # persistent TMA: silu' epilogue; token-chunk scales
        yield f8._fp8_gemm_tma_kernel, gemm_tiles, dict(GROUP_K=group, CHUNK_K=group, EPI=epi, BLOCK_M=128,
                                                        BLOCK_N=128, BLOCK_K=128, GROUP_M=8)
    for one_sweep, col_amax in ((True, False), (True, True), (False, False)):
        yield f8._cast_rows_kernel, f8_io, dict(ACT=1, IN_BF16=True, BIT_CAST=False, BLOCK_R=2,
                                                BLOCK_C=4096 if one_sweep else 2048, ONE_SWEEP=one_sweep,
                                                ITERS=64 if col_amax else 1, COL_AMAX=col_amax)
    yield f8._cast_rows_kernel, f8_io, dict(ACT=0, IN_BF16=True, BIT_CAST=False, BLOCK_R=1, BLOCK_C=1024,
                                            ONE_SWEEP=True, ITERS=64, COL_AMAX=True, NORM=True)  # RMSNorm fused
    yield f8._cast_rows_kernel, dict(f8_io, NW="*i16"), dict(ACT=0, IN_BF16=True, BIT_CAST=False, BLOCK_R=2,
                                                             BLOCK_C=1024, ONE_SWEEP=True, ITERS=1, COL_AMAX=False,
                                                             NORM=True)  # a bf16 weight, as int16 bits
    yield f8._cast_rows_kernel, f8_io, dict(ACT=1, IN_BF16=True, BIT_CAST=False, BLOCK_R=2, BLOCK_C=1024,
                                            ONE_SWEEP=True, ITERS=32, COL_AMAX=True, DEPTH=2)  # two blocks in flight
    for norm in (False, True):  # the loop pipelined by Triton (cp.async)
        yield f8._cast_rows_kernel, f8_io, dict(ACT=int(not norm), IN_BF16=True, BIT_CAST=False, BLOCK_R=1,
                                                BLOCK_C=4096, ONE_SWEEP=True, ITERS=16, COL_AMAX=True, NORM=norm,
                                                DEPTH=0)
    yield f8._cast_rows_kernel, dict(f8_io, PART="*i32"), dict(ACT=1, IN_BF16=True, BIT_CAST=False, BLOCK_R=8,
                                                               BLOCK_C=1024, ONE_SWEEP=True, ITERS=8, COL_AMAX=True,
                                                               ATOMIC=True)  # column bytes by atomic max
    from gemctl.ops.triton import fp8_cast_hopper as f8h

    for act, norm in ((1, False), (0, True)):  # a row per warp (Gluon): silu, RMSNorm fused
        yield f8h._cast_rows_warp_kernel, dict(f8_io, NW="*i16"), dict(ACT=act, IN_BF16=True, BIT_CAST=False,
                                                                      BLOCK_R=8, BLOCK_C=1024, ITERS=2, NORM=norm)
        # ... and its blocks of rows through a shared-memory ring (cp.async; _aligned_attrs)
        yield f8h._cast_rows_warp_kernel, dict(f8_io, NW="*i16"), dict(ACT=act, IN_BF16=True, BIT_CAST=False,
                                                                      BLOCK_R=4, BLOCK_C=1024, ITERS=4, NORM=norm,
                                                                      STAGES=3)
    # the column casts with the transpose in registers (_COLS_PAIRS): bf16 pairs read as int32,
    # plain at 16 rows a thread in 4 warps, SiLU at 8 in 8 warps with 4 programs a chunk
    for act, rows, warps, split in ((0, 16, 4, 1), (1, 8, 8, 4)):
        yield f8h._cast_cols_pairs_kernel, dict(f8_io, X="*i32"), dict(ACT=act, CHUNK=4096, PARTS=256, PART_BLOCK=64,
                                                                       ROWS=rows, LANES_R=4, SPLIT=split,
                                                                       num_warps=warps)
    cast = dict(ACT=1, IN_BF16=True, BIT_CAST=False, CHUNK=4096, BLOCK_R=64, BLOCK_C=64)
    yield f8._cast_cols_kernel, f8_io, cast
    yield f8._cast_cols_amax_kernel, f8_io, dict(cast, PARTS=256, PART_BLOCK=64)  # runs of 16 rows: 4 loads
    yield f8._cast_cols_amax_kernel, f8_io, dict(cast, ACT=0, PARTS=32, PART_BLOCK=32, NORM=True)
    yield f8._cast_cols_amax_kernel, f8_io, dict(cast, PARTS=256, PART_BLOCK=64, STAGES=3)  # the row loop pipelined
    yield f8._cast_cols_amax_kernel, f8_io, dict(cast, PARTS=64, PART_BLOCK=64, SPLIT=4)  # 4 programs per chunk
    # whole tiles unmasked (_COLS_WHOLE), the plain and RMSNorm casts
    yield f8._cast_cols_amax_kernel, f8_io, dict(cast, ACT=0, PARTS=32, PART_BLOCK=32, NORM=True, WHOLE=True)
    yield f8._cast_cols_kernel, f8_io, dict(cast, ACT=0, WHOLE=True)
    # ... at the H200 pick's tile, (256, 64) in 8 warps, under its 128-register cap
    yield f8._cast_cols_amax_kernel, f8_io, dict(cast, ACT=0, BLOCK_R=256, PARTS=256, PART_BLOCK=64, NORM=True,
                                                 WHOLE=True, num_warps=8)
    norm_io = dict(DY="*bf16", X="*bf16", RSTD="*fp32", W="*fp32", DX="*bf16", DWP="*fp32")
    yield rms_norm._rms_norm_bwd_kernel, norm_io, dict(BLOCK_R=2, BLOCK_C=1024, ITERS=32, NEED_DW=True)
    for block, rope in ((64, False), (64, True), (32, True), (128, True)):  # 128 + rope: the most shared memory
        consts = dict(HEAD_DIM=128, BLOCK=block, ROPE=rope)
        yield ba._block_attn_fwd, io, consts
        yield ba._block_attn_bwd, io, consts
    yield ba._block_attn_fwd, io, dict(HEAD_DIM=128, BLOCK=64, ROPE=True, HALVES=True)  # (BS, D/2) halves
    for halves in (False, True):  # the bf16x2 rotation (inline sm_90 PTX: mul.bf16x2, fma.bf16x2)
        yield ba._block_attn_fwd, io, dict(HEAD_DIM=128, BLOCK=64, ROPE=2, HALVES=halves)
    yield ba._block_attn_bwd, io, dict(HEAD_DIM=128, BLOCK=64, ROPE=True, HALVES=True)
    # the picks reading their block from a work record (WORK is then common.query_records)
    yield ba._block_attn_fwd, io, dict(HEAD_DIM=128, BLOCK=64, ROPE=True, HALVES=True, RECORDS=True)
    yield ba._block_attn_bwd, io, dict(HEAD_DIM=128, BLOCK=64, ROPE=True, HALVES=True, RECORDS=True)
    halves, whole = "tensordesc<bf16[64, 64]>", "tensordesc<bf16[64, 128]>"  # whole blocks by TMA
    ba_tiles = dict(io, Q_DESC=halves, K_DESC=halves, V_DESC=whole, O_DESC=whole, DO_DESC=whole)
    yield ba._block_attn_fwd, ba_tiles, dict(HEAD_DIM=128, BLOCK=64, ROPE=True, TMA=True)
    yield ba._block_attn_bwd, ba_tiles, dict(HEAD_DIM=128, BLOCK=64, ROPE=True, TMA=True)
    yield from gluon_kernels()


def gluon_kernels():
    """The Gluon kernels (Hopper only; their descriptors carry the shared-memory layout)."""
    import torch

    from gemctl.ops.triton import block_attention_hopper as bh
    from gemctl.ops.triton import gdpa_hopper as gh

    def desc(rows, dim):
        return f"tensordesc<bf16[{rows}, {dim}],{gh.shared_layout(rows, dim, torch.bfloat16)!r}>"

    # the block attention backward and forward: D=128 with fp16 rope tables (the default for bf16
    # inputs) and without rope, D=64 with fp32 tables
    for dim, table_dtype in ((128, "fp16"), (128, None), (64, "fp32")):
        tile = desc(bh.BLOCK, dim // 2)
        table = tile
        if table_dtype:
            layout = gh.shared_layout(bh.BLOCK, dim // 2, {"fp16": torch.float16, "fp32": torch.float32}[table_dtype])
            table = f"tensordesc<{table_dtype}[{bh.BLOCK}, {dim // 2}],{layout!r}>"
        rope = table_dtype is not None
        # 32-row boxes landing in halves of (BLOCK, D/2) tiles: the tiles' layout
        tile32 = f"tensordesc<bf16[{bh.BLOCK // 2}, {dim // 2}],{gh.shared_layout(bh.BLOCK, dim // 2, torch.bfloat16)!r}>"
        table32 = tile32
        if table_dtype:
            table32 = f"tensordesc<{table_dtype}[{bh.BLOCK // 2}, {dim // 2}],{layout!r}>"
        io = dict(q_desc=tile, k_desc=tile, v_desc=tile, do_desc=tile, dq_desc=tile, dk_desc=tile, dv_desc=tile,
                  cos_desc=table, sin_desc=table, DQ="*bf16", DK="*bf16", DV="*bf16", LSE="*fp32", RECORDS="*i32",
                  qk_scale="fp32", scale="fp32", zero="i32", q32_desc=tile32, k32_desc=tile32, v32_desc=tile32,
                  do32_desc=tile32, cos32_desc=table32, sin32_desc=table32, n_single="i32")
        yield bh._block_attn_bwd_hopper, io, dict(HEAD_DIM=dim, BLOCK=bh.BLOCK, ROPE=rope, num_warps=4)
        if table_dtype == "fp16":  # the paired backward (blocks of at most 32 rows two heads to an item)
            yield bh._block_attn_bwd_hopper, io, dict(HEAD_DIM=dim, BLOCK=bh.BLOCK, ROPE=rope, num_warps=4, PAIR=True)
        io = dict(q_desc=tile, k_desc=tile, v_desc=tile, o_desc=tile, cos_desc=table, sin_desc=table, O="*bf16",
                  LSE="*fp32", RECORDS="*i32", qk_scale="fp32")
        yield bh._block_attn_fwd_hopper, io, dict(HEAD_DIM=dim, BLOCK=bh.BLOCK, ROPE=rope, num_warps=4)

    for block_n, dim, pipeline, act in ((128, 128, 0, 0), (128, 128, 1, 0), (32, 64, 1, 1)):
        io = dict(q_desc=desc(64, dim), o_desc=desc(64, dim), k_desc=desc(block_n, dim), v_desc=desc(block_n, dim),
                  O="*bf16", RECORDS="*i32", scale="fp32")
        yield gh._gdpa_fwd_resident, io, dict(HEAD_DIM=dim, BLOCK_M=64, BLOCK_N=block_n, CHUNK=4, ACT=act, Q_STAGES=2,
                                               LOOKAHEAD=pipeline, FOLD=act == 0, num_warps=4)
    # GELU with the scale applied first (a scale outside the fold range, or fp16): 32 keys at D = 64
    yield gh._gdpa_fwd_resident, io, dict(HEAD_DIM=64, BLOCK_M=64, BLOCK_N=32, CHUNK=4, ACT=0, Q_STAGES=2,
                                           LOOKAHEAD=1, FOLD=False, num_warps=4)
    # the warp-specialized form (a loader warp, two consumer warpgroups): cross-128's two buffer
    # plans at D = 128, and cross-32's at D = 64 with SiLU
    for block_n, dim, q_stages, kv_stages, act in ((128, 128, 4, 2, 0), (128, 128, 6, 1, 0), (32, 64, 8, 2, 1)):
        io = dict(q_desc=desc(64, dim), o_desc=desc(64, dim), k_desc=desc(block_n, dim), v_desc=desc(block_n, dim),
                  O="*bf16", RECORDS="*i32", scale="fp32")
        yield gh._gdpa_fwd_ws, io, dict(HEAD_DIM=dim, BLOCK_M=64, BLOCK_N=block_n, CHUNK=16, ACT=act, Q_STAGES=q_stages,
                                        KV_STAGES=kv_stages, FOLD=act == 0, CONSUMER_REGS=gh.WS_REGS[0],
                                        LOADER_REGS=gh.WS_REGS[1], num_warps=4)
    # its streaming form (any key length: (K, V) tiles through a ring both consumers read): 64-key
    # tiles in 4 stages and 128-key tiles in 2 at D = 128, 32-key tiles in 6 at D = 64 with SiLU
    for block_n, dim, kv_stages, act in ((64, 128, 4, 0), (128, 128, 2, 0), (32, 64, 6, 1)):
        io = dict(q_desc=desc(64, dim), o_desc=desc(64, dim), k_desc=desc(block_n, dim), v_desc=desc(block_n, dim),
                  O="*bf16", RECORDS="*i32", scale="fp32")
        yield gh._gdpa_fwd_ws_stream, io, dict(HEAD_DIM=dim, BLOCK_M=64, BLOCK_N=block_n, ACT=act, KV_STAGES=kv_stages,
                                               FOLD=act == 0, CONSUMER_REGS=gh.WS_REGS[0], LOADER_REGS=gh.WS_REGS[1],
                                               num_warps=4)
    # the benchmark's timing probes (bench_gdpa.py --probes): memory alone, math alone, at 128 keys
    io = dict(io, q_desc=desc(64, 128), o_desc=desc(64, 128), k_desc=desc(128, 128), v_desc=desc(128, 128))
    for probe in (1, 2):
        yield gh._gdpa_fwd_resident, io, dict(HEAD_DIM=128, BLOCK_M=64, BLOCK_N=128, CHUNK=16, ACT=0, Q_STAGES=2,
                                               LOOKAHEAD=1, FOLD=True, num_warps=4, PROBE=probe)
    # and the warp-specialized resident form's (cross-128's pick: 4 query slots, 2 K/V buffers)
    for probe in (1, 2):
        yield gh._gdpa_fwd_ws, io, dict(HEAD_DIM=128, BLOCK_M=64, BLOCK_N=128, CHUNK=16, ACT=0, Q_STAGES=4,
                                        KV_STAGES=2, FOLD=True, CONSUMER_REGS=gh.WS_REGS[0],
                                        LOADER_REGS=gh.WS_REGS[1], num_warps=4, PROBE=probe)


def _source(fn, types: dict, consts: dict, attrs=None):
    """What triton.compile takes for ``fn``: a Triton or a Gluon kernel."""
    from triton.compiler import ASTSource

    consts = {k: v for k, v in consts.items() if k in fn.arg_names}  # num_warps: a launch option (_options)
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource

        return GluonASTSource(fn, _signature(fn, types, consts), consts, attrs)
    return ASTSource(fn=fn, signature=_signature(fn, types, consts), constexprs=consts, attrs=attrs)


def column_cast_stores(target) -> list[str]:
    """The FP8 column casts compiled as a jagged token count launches them (R not a multiple of 16;
    pointers, strides, widths and the padded R_PAD multiples of 16, as Triton specializes them):
    their transposed stores must stay 16-byte vectors (bounded by R they became byte stores)."""
    import re

    import triton
    from triton.compiler import ASTSource

    from gemctl.ops.triton import fp8_gemm as f8

    io = dict(X="*i16", DATA_T="*u8", SCALE="*u8", PART="*u8", NW="*fp32", RSTD="*fp32")
    aligned = ("X", "DATA_T", "SCALE", "PART", "NW", "RSTD", "R_PAD", "Cn", "stride_xr", "stride_dt", "stride_p")
    cast = dict(ACT=1, IN_BF16=True, BIT_CAST=False, CHUNK=4096, BLOCK_R=64, BLOCK_C=64)
    lines = []
    for fn, consts in ((f8._cast_cols_kernel, cast), (f8._cast_cols_amax_kernel, dict(cast, PARTS=64, PART_BLOCK=64,
                                                                                      SPLIT=4)),
                       (f8._cast_cols_amax_kernel, dict(cast, ACT=0, PARTS=32, PART_BLOCK=32, NORM=True)),
                       (f8._cast_cols_amax_kernel, dict(cast, PARTS=64, PART_BLOCK=64, STAGES=3)),
                       (f8._cast_cols_amax_kernel, dict(cast, ACT=0, PARTS=32, PART_BLOCK=32, NORM=True, WHOLE=True))):
        consts = _with_defaults(fn, consts)
        names = list(fn.arg_names)
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned if n in names}
        src = ASTSource(fn=fn, signature=_signature(fn, io, consts), constexprs=consts, attrs=attrs)
        ptx = triton.compile(src, target=target, options=_options(fn, consts, 4, 3)).asm["ptx"]
        vec, byte = len(re.findall(r"st\.global\.v4\.b32", ptx)), len(re.findall(r"st\.global\.b8", ptx))
        verdict = "vector" if vec and byte <= 1 else "BYTE STORES"  # one byte store: the chunk's scale bytes
        lines.append(f"{fn.__name__:<24} jagged R: {vec} st.global.v4.b32, {byte} st.global.b8: {verdict}")
    return lines


PER_BATCH = {  # module: {kernel: its integer arguments that change with every batch}
    "fp8_gemm": {"_fp8_gemm_kernel": ("M",), "_fp8_gemm_tma_kernel": ("M", "K"), "_cast_rows_kernel": ("R",),
                 "_cast_cols_kernel": ("R",), "_cast_cols_amax_kernel": ("R", "n_part")},
    "fp8_cast_hopper": {"_cast_rows_warp_kernel": ("R",)},
    "gdpa": {"_gdpa_fwd": ("n_items",), "_gdpa_bwd_dkdv": ("n_items",), "_gdpa_bwd_dq": ("n_items",)},
    "rms_norm": {"_rms_norm_bwd_kernel": ("R",)},
    "mx_quant": {"_mx_quant_kernel": ("rows",), "_mx_quant_axis0_kernel": ("rows",), "_rmsnorm_mx_quant_kernel": ("rows",)},
    "jagged_attention": {"_bwd_delta": ("n_rows",)},
}


def per_batch_specialization(target) -> list[str]:
    """Triton's own argument binder (what a launch runs) on each kernel with a per-batch size at
    4096, 4097 and 1: the specialization must not change, or a jagged batch compiles the kernel
    again mid-training (common.py, "Specialization"). Control: the kernel's first stride does
    change between 4096 and 4097 (specialized, as it should be), so the check can fail."""
    import importlib

    import torch
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    aligned = torch.empty(64, dtype=torch.uint8)
    lines = []
    for module, kernels_ in PER_BATCH.items():
        mod = importlib.import_module(f"gemctl.ops.triton.{module}")
        for name, sizes in kernels_.items():
            fn = getattr(mod, name)
            binder = create_function_from_signature(fn.signature, fn.params, backend)

            def spec(**override):
                args = []
                for p in fn.params:
                    if p.is_constexpr:
                        args.append(p.default if p.has_default else 1)
                    elif p.name in override:
                        args.append(override[p.name])
                    elif p.name[0].isupper() or p.name.endswith("_desc"):
                        args.append(aligned)
                    elif p.name in ("eps", "scale", "qk_scale"):
                        args.append(1.0)
                    else:
                        args.append(4096)
                return str(binder(*args)[1])

            stable = all(spec(**{n: v}) == spec(**{n: 4096}) for n in sizes for v in (4097, 1))
            stride = next(p.name for p in fn.params if p.name.startswith("stride"))
            control = spec(**{stride: 4097}) != spec(**{stride: 4096})
            verdict = "stable" if stable and control else ("SPECIALIZED" if not stable else "CONTROL FAILED")
            lines.append(f"{name:<24} per-batch {','.join(sizes)}: {verdict}")
    return lines


def _constexprs(fn, types: dict, consts: dict) -> dict:
    """``consts`` with the kernel's constexpr defaults, and its tensor-descriptor arguments None
    where the kernel is compiled without TMA."""
    consts = _with_defaults(fn, consts)
    consts.update({n: None for n in fn.arg_names if n.endswith("_DESC") and n not in types and n not in consts})
    return consts


def _options(fn, consts: dict, warps: int, stages: int) -> dict:
    """Compile options as a launch passes them: warps, stages, and the register limits of the
    warp-specialized kernels (its partitions' shares are set against it) and of the column casts'
    whole-tile configs (fp8_gemm._cols_reg_cap)."""
    from gemctl.ops.triton import fp8_gemm as f8
    from gemctl.ops.triton import gdpa_hopper as gh

    options = {"num_warps": consts.get("num_warps", warps), "num_stages": stages}
    if fn in (gh._gdpa_fwd_ws, gh._gdpa_fwd_ws_stream):
        options["maxnreg"] = gh.WS_MAXNREG
    if consts.get("WHOLE"):
        options["maxnreg"] = f8._cols_reg_cap(options["num_warps"])
    return options


def _flags(consts: dict) -> str:
    """The variant a compile is: its integer and boolean constexprs other than tile sizes."""
    return ",".join(f"{k}={int(v)}" for k, v in consts.items()
                    if isinstance(v, (bool, int)) and k.isupper() and not k.startswith(("BLOCK_", "HEAD_DIM")))


def _ring(fn, consts: dict) -> bool:
    """The Gluon row cast with its shared-memory ring: built only for 16-aligned rows (fp8_gemm._ring_fits)."""
    return fn.__name__ == "_cast_rows_warp_kernel" and bool(consts.get("STAGES"))


def _aligned_attrs(fn, types: dict, consts: dict) -> dict:
    """Triton's specialization of a typical launch: every pointer 16-byte aligned and every stride a
    multiple of 16, as our tensors have them. That includes the rope tables' row stride (D/2 in
    {16, 32, 64} elements): left unspecialized, the table loads compile to one 2-byte load per
    element with its own 64-bit address, which the launched kernel never runs (the half-width
    block-attention backward with its head loop: 648 B of spills a thread instead of 100; SASS of
    the half-width forward 2,040 instructions instead of 1,840)."""
    names = list(fn.arg_names)
    aligned = [n for n in names if n not in consts
               and (types.get(n, "").startswith("*") or n.startswith("stride") or (n == "Cn" and _ring(fn, consts)))]
    return {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}


# Per-SM limits of sm_90 (H100/H200), the architecture --ptxas reports occupancy for: registers,
# shared memory a kernel can use (the largest carve-out), shared memory the runtime reserves per
# block, warps, blocks. With the allocation rules of programs_per_sm they reproduce Nsight Compute's
# "Block Limit" figures of every kernel profiled on the H200 (docs/runs/*ncu*).
_SM90_LIMITS = (65536, 233472, 1024, 64, 32)


def programs_per_sm(registers: int, warps: int, shared: int) -> tuple[int, str]:
    """Resident programs (thread blocks) per sm_90 SM for a kernel of ``registers`` per thread,
    ``warps`` warps and ``shared`` bytes of shared memory, and what limits them ("registers",
    "shared memory", "warps", "blocks"; ties name each; 0 programs: the kernel does not fit).
    Registers are allocated per warp in units of 256 from the SM's four sub-partitions of 16,384
    (a warp's registers come from one of them), shared memory in units of 128 bytes."""
    regs_sm, smem_sm, smem_reserved, warps_sm, blocks_sm = _SM90_LIMITS
    limits = {"warps": warps_sm // warps, "blocks": blocks_sm}
    if registers:
        per_warp = -(-registers * 32 // 256) * 256
        limits["registers"] = (regs_sm // 4 // per_warp) * 4 // warps
    limits["shared memory"] = smem_sm // (-(-shared // 128) * 128 + smem_reserved)
    n = min(limits.values())
    return n, " and ".join(k for k, v in limits.items() if v == n)


def ptxas_stats(target, warps: int, stages: int, head_loop: bool = False) -> list[str]:
    """Registers and spill stores per thread (``ptxas -v`` on its PTX, the ptxas Triton bundles),
    shared memory and, for sm_90, programs per SM (programs_per_sm) of every kernel above, compiled as
    a launch specializes it (_aligned_attrs; block attention with one head per program, or with
    ``head_loop`` its head loop) with ``warps`` and ``stages``: figures that docs/benchmarks.md can
    quote, reproducible without a GPU (Triton's version changes them: name it)."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton import knobs

    lines = []
    for fn, types, consts in kernels():
        consts = _constexprs(fn, types, consts)
        if "heads_per_program" in fn.arg_names and not head_loop:
            consts["heads_per_program"] = 1  # Triton specializes the value 1: one-head configs get no loop
        src = _source(fn, types, consts, _aligned_attrs(fn, types, consts))
        compiled = triton.compile(src, target=target, options=_options(fn, consts, warps, stages))
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
            ptx.write(compiled.asm["ptx"])
            ptx.flush()
            def ptxas(path):
                return subprocess.run([path, "-v", f"--gpu-name=sm_{target.arch}a", ptx.name, "-o", os.devnull],
                                      capture_output=True, text=True).stderr

            out = ptxas(knobs.nvidia.ptxas.path)
            newer = knobs.nvidia.ptxas.path + "-blackwell"  # Triton 3.9's PTX 9.x: only its CUDA 13 ptxas reads it
            if "Unsupported .version" in out and os.path.exists(newer):
                out = ptxas(newer)
        regs = re.search(r"Used (\d+) registers", out)
        spill = re.search(r"(\d+) bytes spill stores", out)
        occupancy = ""
        if regs and target.arch == 90:
            n, limit = programs_per_sm(int(regs.group(1)), compiled.metadata.num_warps, compiled.metadata.shared)
            occupancy = f", {n} per SM ({limit})" if n else f", does not fit an SM ({limit})"
        lines.append(f"{fn.__name__:<24} {_flags(consts):<60} {regs.group(1) if regs else '?':>3} registers, "
                     f"{spill.group(1) if spill else '?':>4} B spill stores, {compiled.metadata.shared} B shared"
                     f"{occupancy}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--ptxas", metavar="WARPS,STAGES",
                    help="print registers, spills, shared memory and programs per SM per kernel (e.g. 4,1) instead")
    ap.add_argument("--head-loop", action="store_true",
                    help="with --ptxas: block attention as configs with several heads per program launch it "
                         "(the forward's (4, 2, 0, ...) picks), not with one")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("check_kernels_build: unset TRITON_INTERPRET (the interpreter compiles nothing)", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", args.arch, 32)
    if args.ptxas:
        try:
            warps, stages = (int(v) for v in args.ptxas.split(","))
        except ValueError:
            ap.error(f"--ptxas {args.ptxas}: WARPS,STAGES expected, e.g. 4,1")
        print("\n".join(ptxas_stats(target, warps, stages, args.head_loop)))
        return 0
    for fn, types, consts in kernels():
        t0 = time.time()
        consts = _constexprs(fn, types, consts)
        # unaligned, but the row casts' ring: its cp.async needs the 16-aligned rows the host checks (_ring_fits)
        src = _source(fn, types, consts, _aligned_attrs(fn, types, consts) if _ring(fn, consts) else None)
        compiled = triton.compile(src, target=target, options=_options(fn, consts, 4, 3))
        print(f"{fn.__name__:<24} {_flags(consts):<30} sm_{args.arch}: ok ({time.time() - t0:.1f} s, {compiled.metadata.shared} B shared)")
    stores = column_cast_stores(target)
    print("\n".join(stores))
    specs = per_batch_specialization(target)
    print("\n".join(specs))
    return 1 if any(ln.endswith("BYTE STORES") for ln in stores) or any(not ln.endswith(": stable") for ln in specs) else 0


if __name__ == "__main__":
    sys.exit(main())
