"""The FP8 casts' Gluon kernels for Hopper (sm_90+), loaded through common.gluon_module where they
can run: Gluon's API changes between Triton releases, so a Triton without it keeps fp8_gemm's
Triton casts working and only leaves these configs out.

A row per warp: fp8_gemm._cast_rows_kernel lays a block's warps along the columns (Triton's
choice, not ours), so its multi-warp programs pay a block barrier per block of rows. Here an
explicit layout puts the warps on the rows. The per-block work is fp8_gemm's own Triton helpers,
called from Gluon in its layouts. Autotuned with the Triton configs (fp8_gemm._ROWS_WARP).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from gemctl.ops.triton.fp8_gemm import _cast_row_block, _load_raw, _norm_weight, _scale_from_amax


@gluon.jit(do_not_specialize=["R"])  # per-batch sizes: common.py, "Specialization"
def _cast_rows_warp_kernel(
    X, DATA, SCALE, PART, NW, RSTD, R, Cn, stride_xr, stride_dr, stride_p, eps,
    ACT: gl.constexpr, IN_BF16: gl.constexpr, BIT_CAST: gl.constexpr,
    BLOCK_R: gl.constexpr, BLOCK_C: gl.constexpr, ITERS: gl.constexpr, NORM: gl.constexpr,
):
    """_cast_rows_kernel's ONE_SWEEP + COL_AMAX loop (the same per-block helper, the same outputs;
    the RMSNorm's sum of squares in another order) with each row inside one warp: Gluon's layout
    puts the warps on the rows (BLOCK_R a multiple of the warps) and a warp's 32 lanes x 8 values on
    the columns (BLOCK_C a multiple of 256), so a row's maxima and sum are shuffles within its warp.
    Triton lays the warps along the columns first: its multi-warp programs take a block barrier per
    block of rows (two with the norm), and its one-warp programs cap an SM at 32 programs' warps.
    The column maxima accumulate element-wise and cross the warps once, after the loop."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    pid = gl.program_id(0)
    cc = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, layout))
    cmask = (cc < Cn)[None, :]
    nw = _norm_weight(X, NW, cc, cc < Cn, IN_BF16, BIT_CAST) if NORM else 0.0
    col = gl.zeros((BLOCK_R, BLOCK_C), gl.int32, layout)
    rr = pid * ITERS * BLOCK_R + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, layout))
    raw = _load_raw(X + rr.to(gl.int64)[:, None] * stride_xr + cc[None, :], (rr < R)[:, None] & cmask)
    for i in range(ITERS):
        nxt = rr + BLOCK_R  # the next block requested before this one is reduced: one in flight
        raw_next = _load_raw(X + nxt.to(gl.int64)[:, None] * stride_xr + cc[None, :],
                             (nxt < R)[:, None] & cmask & (i + 1 < ITERS))
        bits = _cast_row_block(X, DATA, SCALE, RSTD, raw, rr, cc, cmask, nw, R, Cn, stride_dr, eps, ACT, IN_BF16,
                               BIT_CAST, NORM)
        col = gl.maximum(col, bits)
        rr, raw = nxt, raw_next
    # the column maxima cross the warps once: every row of a column into one thread (a layout change
    # through shared memory), then an in-thread reduction
    by_cols: gl.constexpr = gl.BlockedLayout([BLOCK_R, 8], [1, 32], [1, gl.num_warps()], [1, 0])
    col_byte, _, _ = _scale_from_amax(gl.max(gl.convert_layout(col, by_cols), axis=0))
    cb = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, by_cols))
    gl.store(PART + pid.to(gl.int64) * stride_p + cb, col_byte, mask=cb < Cn)
