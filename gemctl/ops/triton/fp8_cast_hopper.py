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

from gemctl.ops.triton.fp8_gemm import (_cast_row_block, _fold_runs, _load_raw, _norm_weight, _quantize,
                                       _quantize_scaled, _scale_factor, _scale_from_amax, _scales_from_byte,
                                       _silu_scaled)

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


@gluon.constexpr_function
def _rows_first(rows, lanes_r, warps):
    """_cast_cols_pairs_kernel's load layout, BlockedLayout([rows, 4], [lanes_r, 32 // lanes_r],
    [warps, 1], [1, 0]), with each thread's registers ordered along the rows first: the same
    elements in the same threads, so converting between the two renames registers (no shuffle, no
    shared memory)."""
    lanes_c = 32 // lanes_r

    def log2(n):
        return n.bit_length() - 1

    reg = [[1 << i, 0] for i in range(log2(rows))] + [[0, 1], [0, 2]]
    lane = [[0, 4 << i] for i in range(log2(lanes_c))] + [[rows << i, 0] for i in range(log2(lanes_r))]
    warp = [[(rows * lanes_r) << i, 0] for i in range(log2(warps))]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [rows * lanes_r * warps, 4 * lanes_c])


@gluon.jit
def _pair_codes(w, s0, n0, s1, n1, ACT: gl.constexpr):
    """E4M3 codes of the bf16 pairs w (int32: column 2j in the low half, 2j + 1 in the high half),
    widened by a shift and a mask: (codes of 2j, codes of 2j + 1). s: the columns' 2^shared with
    SiLU (_silu_scaled), else 2^-shared."""
    lo = (w << 16).to(gl.float32, bitcast=True)
    hi = (w & -65536).to(gl.float32, bitcast=True)
    if ACT == 1:
        return (_quantize_scaled(_silu_scaled(lo, s0[None, :]), n0[None, :], False),
                _quantize_scaled(_silu_scaled(hi, s1[None, :]), n1[None, :], False))
    return _quantize(lo, s0[None, :], n0[None, :], False), _quantize(hi, s1[None, :], n1[None, :], False)


@gluon.jit(do_not_specialize=["R", "n_part"])  # per-batch sizes: common.py, "Specialization"
def _cast_cols_pairs_kernel(
    X, DATA_T, SCALE, PART, R, R_PAD, n_part, stride_xr, stride_dt, stride_sc, stride_p,
    ACT: gl.constexpr, CHUNK: gl.constexpr, PARTS: gl.constexpr, PART_BLOCK: gl.constexpr,
    ROWS: gl.constexpr, LANES_R: gl.constexpr, SPLIT: gl.constexpr,
):
    """fp8_gemm._cast_cols_amax_kernel (plain or SiLU, bf16, from the row cast's run bytes) with the
    transpose in registers. X: the bf16 rows as int32 pairs [R, Cn / 2] (stride_xr in pairs); the
    grid covers Cn exactly (Cn a multiple of 8 * 32 // LANES_R columns). Each thread holds ROWS
    consecutive rows x 4 pairs (one 16-byte load a row); the pairs widen by a shift (low value) and
    a mask (high value), and in _rows_first's layout each column's ROWS codes leave as one store
    into DATA_T [Cn, R]. The Triton kernel transposes each tile through shared memory (interleave,
    STS, LDSM, then STSM and LDS on the way out, with block barriers): sm_90 SASS (Triton 3.6) of the
    whole-tile loop, 8.64 instructions an element with SiLU and 4.78 without, against 7.11 and 3.16
    here (16 rows, 4 warps; docs/runs/2026-12-07_gluon_cols_register_transpose_probe.py)."""
    LANES_C: gl.constexpr = 32 // LANES_R
    PAIRS: gl.constexpr = 4 * LANES_C
    BLOCK_R: gl.constexpr = ROWS * LANES_R * gl.num_warps()
    load_l: gl.constexpr = gl.BlockedLayout([ROWS, 4], [LANES_R, LANES_C], [gl.num_warps(), 1], [1, 0])
    rows_l: gl.constexpr = _rows_first(ROWS, LANES_R, gl.num_warps())
    part_l: gl.constexpr = gl.BlockedLayout([1, 4], [LANES_R, LANES_C], [gl.num_warps(), 1], [1, 0])
    g = gl.program_id(1)
    split = gl.program_id(2)
    # the chunk's scales of columns 2j and 2j + 1 from the run bytes (two folds)
    jp = gl.program_id(0) * PAIRS + gl.arange(0, PAIRS, layout=gl.SliceLayout(0, part_l))
    col0 = gl.zeros((PART_BLOCK, PAIRS), PART.dtype.element_ty, part_l)
    col1 = gl.zeros((PART_BLOCK, PAIRS), PART.dtype.element_ty, part_l)
    runs = gl.arange(0, PART_BLOCK, layout=gl.SliceLayout(1, part_l))
    every = jp >= 0  # the grid covers the columns exactly
    for p0 in range(g * PARTS, g * PARTS + PARTS, PART_BLOCK):
        col0 = _fold_runs(col0, PART, p0 + runs, 2 * jp, every, n_part, stride_p)
        col1 = _fold_runs(col1, PART, p0 + runs, 2 * jp + 1, every, n_part, stride_p)
    byte0, inv0, nan0 = _scales_from_byte(gl.max(col0, axis=0).to(gl.int32))
    byte1, inv1, nan1 = _scales_from_byte(gl.max(col1, axis=0).to(gl.int32))
    first = split == 0
    gl.store(SCALE + (2 * jp).to(gl.int64) * stride_sc + g, byte0.to(gl.uint8), mask=first & every)
    gl.store(SCALE + (2 * jp + 1).to(gl.int64) * stride_sc + g, byte1.to(gl.uint8), mask=first & every)
    if ACT == 1:  # SiLU takes the scale in its reciprocal (_silu_scaled)
        inv0 = _scale_factor(inv0, nan0)
        inv1 = _scale_factor(inv1, nan1)
    cols_l: gl.constexpr = gl.SliceLayout(0, rows_l)
    s0 = gl.convert_layout(inv0, cols_l)
    s1 = gl.convert_layout(inv1, cols_l)
    n0 = gl.convert_layout(nan0, cols_l)
    n1 = gl.convert_layout(nan1, cols_l)
    start = g * CHUNK + split * (CHUNK // SPLIT)
    end = gl.minimum(start + CHUNK // SPLIT, R)
    store_end = gl.minimum(start + CHUNK // SPLIT, R_PAD)
    rows = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, load_l))
    jj = gl.program_id(0) * PAIRS + gl.arange(0, PAIRS, layout=gl.SliceLayout(0, load_l))
    rows_o = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, rows_l))
    jj_o = gl.program_id(0) * PAIRS + gl.arange(0, PAIRS, layout=cols_l)
    xp = X + (start + rows).to(gl.int64)[:, None] * stride_xr + jj[None, :]
    op = DATA_T + (2 * jj_o).to(gl.int64)[None, :] * stride_dt + (start + rows_o)[:, None]
    step = BLOCK_R * stride_xr.to(gl.int64)
    for r0 in range(start, end, BLOCK_R):
        if r0 + BLOCK_R <= end:  # a whole tile: no masks
            c0, c1 = _pair_codes(gl.convert_layout(gl.load(xp), rows_l), s0, n0, s1, n1, ACT)
            gl.store(op, c0)
            gl.store(op + stride_dt, c1)
        else:  # the range's last tile: rows past end read as 0 (code 0), stores up to store_end
            w = gl.load(xp, mask=(r0 + rows < end)[:, None] & (jj >= 0)[None, :], other=0)
            c0, c1 = _pair_codes(gl.convert_layout(w, rows_l), s0, n0, s1, n1, ACT)
            keep = (r0 + rows_o < store_end)[:, None] & (jj_o >= 0)[None, :]
            gl.store(op, c0, mask=keep)
            gl.store(op + stride_dt, c1, mask=keep)
        xp += step
        op += BLOCK_R
