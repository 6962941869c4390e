"""The FP8 casts' Gluon kernels for Hopper (sm_90+), loaded through common.gluon_module where they
can run: Gluon's API changes between Triton releases, so a Triton without it keeps fp8_gemm's
Triton casts working and only leaves these configs out.

A row per warp: fp8_gemm._cast_rows_kernel lays a block's warps along the columns (Triton's
choice, not ours), so its multi-warp programs pay a block barrier per block of rows. Here an
explicit layout puts the warps on the rows. The per-block work is fp8_gemm's own Triton helpers,
called from Gluon in its layouts. Autotuned with the Triton configs (fp8_gemm._ROWS_WARP).

Blocks of rows through shared memory (STAGES > 0): every looping row cast, Triton's and the
register-prefetch form here, holds its next block in registers, and the column maxima, the
widened block and its codes take the rest: 180-255 registers a thread at C=1024 (sm_90 ptxas),
so 2-8 programs and 8 warps an SM, one block each in flight, ~16 KB an SM. An H200 needs about
twice that in flight to keep its 4.8 TB/s busy, which is where those casts fell to 73-77% of copy
against 87-89% on an H100. With STAGES, blocks land in a shared-memory ring by cp.async
(STAGES - 1 in flight, no registers held for them). Each thread copies the very elements it later
reads (the copy and the read take one layout), so its own wait_group would order them; Triton's
barrier pass still puts a block barrier before each refill and after each wait (two per block
of rows: nothing for the one-warp configs, a CTA barrier for the others).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from gemctl.ops.triton.fp8_gemm import _cast_row_block, _load_raw, _norm_weight, _scale_from_amax

# cp.async into shared memory: async_load since Triton 3.7 (async_copy_global_to_shared, the 3.6
# name, raises there)
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@gluon.jit(do_not_specialize=["R"])  # per-batch sizes: common.py, "Specialization"
def _cast_rows_warp_kernel(
    X, DATA, SCALE, PART, NW, RSTD, R, Cn, stride_xr, stride_dr, stride_p, eps,
    ACT: gl.constexpr, IN_BF16: gl.constexpr, BIT_CAST: gl.constexpr,
    BLOCK_R: gl.constexpr, BLOCK_C: gl.constexpr, ITERS: gl.constexpr, NORM: gl.constexpr,
    STAGES: gl.constexpr = 0,
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
    if STAGES == 0:
        raw = _load_raw(X + rr.to(gl.int64)[:, None] * stride_xr + cc[None, :], (rr < R)[:, None] & cmask)
        for i in range(ITERS):
            nxt = rr + BLOCK_R  # the next block requested before this one is reduced: one in flight
            raw_next = _load_raw(X + nxt.to(gl.int64)[:, None] * stride_xr + cc[None, :],
                                 (nxt < R)[:, None] & cmask & (i + 1 < ITERS))
            bits = _cast_row_block(X, DATA, SCALE, RSTD, raw, rr, cc, cmask, nw, R, Cn, stride_dr, eps, ACT,
                                   IN_BF16, BIT_CAST, NORM)
            col = gl.maximum(col, bits)
            rr, raw = nxt, raw_next
    else:
        ring = gl.allocate_shared_memory(X.dtype.element_ty, [STAGES, BLOCK_R, BLOCK_C],
                                         gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        for s in gl.static_range(STAGES - 1):  # the first STAGES - 1 blocks requested
            _copy_block(ring.index(s), X, rr + s * BLOCK_R, cc, cmask, R, stride_xr, s < ITERS)
        for i in range(ITERS):
            # block i + STAGES - 1 into the slot block i - 1 was read from
            _copy_block(ring.index((i + STAGES - 1) % STAGES), X, rr + (STAGES - 1) * BLOCK_R, cc, cmask, R,
                        stride_xr, i + STAGES - 1 < ITERS)
            async_copy.wait_group(STAGES - 1)  # this thread's copies of block i have landed
            raw = ring.index(i % STAGES).load(layout)
            bits = _cast_row_block(X, DATA, SCALE, RSTD, raw, rr, cc, cmask, nw, R, Cn, stride_dr, eps, ACT,
                                   IN_BF16, BIT_CAST, NORM)
            col = gl.maximum(col, bits)
            rr += BLOCK_R
        async_copy.wait_group(0)
    # the column maxima cross the warps once: every row of a column into one thread (a layout change
    # through shared memory), then an in-thread reduction
    by_cols: gl.constexpr = gl.BlockedLayout([BLOCK_R, 8], [1, 32], [1, gl.num_warps()], [1, 0])
    col_byte, _, _ = _scale_from_amax(gl.max(gl.convert_layout(col, by_cols), axis=0))
    cb = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, by_cols))
    gl.store(PART + pid.to(gl.int64) * stride_p + cb, col_byte, mask=cb < Cn)


@gluon.jit
def _copy_block(slot, X, rr, cc, cmask, R, stride_xr, valid):
    """Rows rr of X (zeros past R, or everywhere unless valid) into the ring slot by cp.async, as
    one commit group."""
    _async_load(slot, X + rr.to(gl.int64)[:, None] * stride_xr + cc[None, :], mask=(rr < R)[:, None] & cmask & valid)
    async_copy.commit_group()
