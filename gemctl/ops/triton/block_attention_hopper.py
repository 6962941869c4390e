"""Block attention for Hopper in Gluon: persistent programs, the next item loading during this one.

The backward (_block_attn_bwd_hopper) and, on the same plan, the forward (_block_attn_fwd_hopper:
s by wgmma, the softmax in registers, o = p v with p as the register operand, o staged in v's
tiles). Same math, work list and outputs as gemctl.ops.triton.block_attention's kernels (see its
docstring); the backward, per (block, head) item, p = exp2(s - lse), dv = p^T do, dp = do v^T,
delta = rowsum(p dp), ds = p (dp - delta), dq~ = ds k~, dk~ = ds^T q~, and the rotations' backward
on dq~ and dk~.

Why a second backward: the Triton backward stays at 66-67% of its memory roofline on the H200
(docs/benchmarks.md, block_attention). Each of its programs loads its block, computes and stores in
sequence, and at 168 registers only three fit an SM, so little memory traffic is in flight; every
variant that kept more in flight in Triton (pipelined head loops, TMA tiles, prefetch into L2, more
warps) spilled or lost occupancy. Gluon states the schedule directly:

- persistent programs (two per SM; the forward three), items (block, head) dealt in rounds (item
  pid + r * programs); a round reads the record of the item after next (_record), so its fields
  have landed when they are needed;
- the backward forms p's shared-memory descriptors inside the item loop (``z``, a zero the
  compiler cannot fold): hoisted out of it, the MMAs' descriptors held ~40 vector registers across
  the loop and spilled (255 registers and 92 B of spills against 214 and none; the warps' top
  stalls waited on the reloads, and the kernel was 9% slower on an H100);
- every tile is a (BS, D/2) half (q, k, v, do in, dq, dk, dv out), 8 KB at BS = 64, D = 128, one
  TMA box each, landing in shared memory by TMA on an mbarrier per input;
- the rotation runs in registers on q and k together (the rope rows read once) and writes the
  rotated halves back to the same shared memory, where every MMA reads them: no rotated copy in
  HBM, none held in registers;
- all five GEMMs are asynchronous wgmma with both operands in shared memory, except where one is
  the accumulator of another (p, ds go through one (BS, BS) shared tile: p^T and ds^T are its
  transposed views);
- the backward's tiles: two for q (this item's and the next one's), two that k and v share with
  their roles swapping each item, one for do. The next item's q loads a whole item ahead, its k
  into v's tile as soon as dp's MMA has read it, its do once dv's stores have read do's tile
  (before dq's MMAs), its v into k's tile as soon as dq's MMA has read it, its rope rows once dq's
  stores have read their tiles (while dk's MMAs run). With q and k
  loading during the last gradients' stores only (one tile each), the warps waited at the top of
  every item on them for 17% of their stall samples (Nsight Compute, H100, 2026-12-05); this
  schedule takes 196 us instead of 216 at self-1000 on the H200 (9% less; block_attention.py,
  _HOPPER_BWD_CANDIDATES, has the runs);
- gradients are staged in tiles read by then (dv in do's, dq in the rope rows', dk in q's; the
  forward's o in v's) and leave by TMA stores; the last, partial block of a sequence by masked
  stores (a TMA box would write into the next sequence's rows). dq staged in k's tile made the
  next item's v wait for dq's stores: the wait before dp's MMA was the top stall (8% of the
  samples, H100, 2026-12-06); staged in the rope rows' tiles, the tables (L2-resident) wait
  instead, and the backward is 1.0% faster at self-1000 on an H100 with fp16 tables (on the H200
  it is level: 195.8 against 196.4 us, where the rope rows' wait became the top stall, 10.9% of the
  samples, and the backward without rope takes as long). fp32 tables (one program per SM) measured
  3-8% slower with it on an H100; their old order back was 2% slower at self-1000 on the H200 and
  stays a file (docs/runs/2026-12-06_block_bwd_fp32_tables_dq_in_k.patch). The next item's rows
  requested into L2 a round early (prefetch.global.L2) made both kernels 5-8% slower on an H100,
  whole or held to 96 SMs (docs/runs/2026-12-06_block_l2_prefetch.patch).

Rows past the sequence's end in a partial last block (the TMA boxes read the next sequence's rows,
or TMA's zero fill at the tensor's end): the backward zeroes q, k and do there in shared memory
(q and k by the rotation pass) before any MMA reads them, selects 0 for dp's columns of the keys
there (v's rows stay as loaded: dp = do v^T is the only product that reads them), and p is 0 for
them (keys by a mask, queries by lse = inf); the forward zeroes v there (and q, k with rope),
sets those keys' scores to -inf by a select and never stores those query rows. So, as with the
Triton kernels' masked loads, nothing there reaches an output or a gradient, not even a non-finite
value.

Paired backward (PAIR, pending its GPU tier): the backward's time follows its number of items (block,
head), whole or partial (H200 and H100, docs/benchmarks.md), so each block of at most 32 rows runs
as one item per two adjacent heads, one head's rows in each half of every tile (32-row TMA boxes;
paired_records puts those blocks last). Rows are then (row & 31, head + row >> 5), and a pair's
scores across its two heads are masked like keys past the sequence. sm_90 ptxas (Triton 3.6),
D=128 with fp16 tables: 255 registers, 4 B of spills (240 and none without PAIR, whose code is
unchanged: 4,288 SASS instructions either way).

Supported: bf16/fp16, D in {64, 128}, block 64, heads adjacent in memory ([N, H * D] rows with
16-byte aligned strides, at least one block of rows), sm_90+. No interpreter: the CPU tier compiles
it for sm_90 (scripts/check_kernels_build.py), the GPU tier checks it against float64
(tests/test_block_attention_triton.py).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.language.nvidia.hopper import tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from gemctl.ops.triton.common import _RECORD as RECORD, num_programs, records_short_last, rows_viewable
from gemctl.ops.triton.gdpa_hopper import (
    SMEM_PER_SM as _SMEM_PER_SM, SMEM_RESERVED as _SMEM_RESERVED,
    _GL_DTYPES, ELEMENT_TYPES, _acc_layout, _cta_barrier, _tma_load, _tma_store, shared_layout,
)

BLOCK = 64  # rows of a block: one warpgroup's wgmma M
# shared_memory_descriptor.reinterpret: `_reinterpret` up to Triton 3.8, `reinterpret` from 3.9
_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))


@gluon.jit
def _pair_slot(e, n_items, n_single, num_heads):
    """PAIR's item e: (record index, first head, whether it is a pair). Items below ``n_single`` are
    (record, head) as without PAIR; the rest take two adjacent heads of one short block each (the
    records of short blocks are the last ones: paired_records)."""
    ec = gl.minimum(e, n_items - 1)
    paired = ec >= n_single
    ep = gl.maximum(ec - n_single, 0)
    pairs = num_heads // 2
    rec = gl.where(paired, n_single // num_heads + ep // pairs, ec // num_heads)
    return rec, gl.where(paired, 2 * (ep % pairs), ec % num_heads), paired


@gluon.jit
def _record(e, n_items, RECORDS, num_heads, PAIR: gl.constexpr = False, n_single=0):
    """Item e's record (e clamped to the last item), its loads issued: a round loads the record of
    the item after next and reads its fields (_item) one round later, when they have landed. Each
    lane holds one field: loaded as scalars (or as a tensor every thread holds whole) the compiler
    moved the fields into uniform registers right after the loads, and the warps waited there for
    them; for 18% of their stall samples when the record was read in the round that needed it
    (Nsight Compute, H100, 2026-12-05)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    if PAIR:
        rec, _, _ = _pair_slot(e, n_items, n_single, num_heads)
    else:
        rec = gl.minimum(e, n_items - 1) // num_heads
    row = RECORDS + rec * RECORD
    return gl.load(row + gl.arange(0, RECORD, layout=layout))


@gluon.jit
def _field(record, i: gl.constexpr):
    """Field i of a _record tensor (a reduction across the lanes)."""
    index = gl.arange(0, RECORD, layout=record.type.layout)
    return gl.sum(gl.where(index == i, record, 0), 0)


@gluon.jit
def _item(e, n_items, record, num_heads, BLOCK: gl.constexpr, HALF: gl.constexpr):
    """Item e's fields from its _record: valid = e < n_items, the sequence's start and length, the
    block's first position in it and its head's column (of half 0) in the [N, H * D] views."""
    first = _field(record, 1) * BLOCK
    return (e < n_items, _field(record, 2), _field(record, 3), first,
            (gl.minimum(e, n_items - 1) % num_heads) * (2 * HALF))


@gluon.jit
def _pair_item(e, n_items, n_single, record, num_heads, BLOCK: gl.constexpr, HALF: gl.constexpr):
    """_item's fields for PAIR, then the item's row mask and head shift: a pair's tile rows i are
    row i & 31 of the block in head (first head) + (i >> 5); a single's, row i & 63 of its head."""
    _, head, paired = _pair_slot(e, n_items, n_single, num_heads)
    return (e < n_items, _field(record, 2), _field(record, 3), _field(record, 1) * BLOCK, head * (2 * HALF),
            gl.where(paired, BLOCK // 2 - 1, BLOCK - 1), gl.where(paired, 5, 6))


@gluon.jit
def _row_pos(i, rm, PAIR: gl.constexpr):
    """Tile row i's row within the block: i, or with PAIR i & rm (a pair's second head from row 32)."""
    if PAIR:
        return i & rm
    return i


@gluon.jit
def _row_head(i, sh, PAIR: gl.constexpr):
    """Tile row i's head after the item's first: 0, or with PAIR i >> sh (1 for a pair's rows 32-63)."""
    if PAIR:
        return i >> sh
    return i * 0


@gluon.jit
def _copy_pair(desc, smem, b, bar, row, col, pred, HALF: gl.constexpr):
    """The TMA copies of both halves of a (BS, D) tile into smem[b], smem[b + 1] onto ``bar`` (the
    caller expects their bytes)."""
    _tma_load(desc, [row, col], bar, smem.index(b), pred)
    _tma_load(desc, [row, col + HALF], bar, smem.index(b + 1), pred)


@gluon.jit
def _copy_tables(cos_desc, sin_desc, cs_smem, bar, position, pred):
    """The TMA copies of the cos and sin rows of a block's positions into cs_smem[0], [1] onto
    ``bar`` (rows past the tables' end are TMA's zero fill; the caller expects their bytes)."""
    _tma_load(cos_desc, [position, 0], bar, cs_smem.index(0), pred)
    _tma_load(sin_desc, [position, 0], bar, cs_smem.index(1), pred)


@gluon.jit
def _load_pair(desc, smem, b, bar, row, col, pred, HALF: gl.constexpr):
    """Both halves of a (BS, D) tile into smem[b], smem[b + 1], signalling ``bar`` (one phase)."""
    mbarrier.expect(bar, 2 * desc.block_type.nbytes, pred=pred)
    _copy_pair(desc, smem, b, bar, row, col, pred, HALF)


@gluon.jit
def _load_pair_split(desc, desc32, smem, b, bar, row, col, pred, rm, HALF: gl.constexpr, PAIR: gl.constexpr):
    """_load_pair, or with PAIR for a pair (rm < 63) its two heads' 32 rows as the tiles' halves
    [0, 32) and [32, 64): four 32-row boxes of desc32 per (BS, D) tile, the same bytes."""
    if PAIR:
        mbarrier.expect(bar, 2 * desc.block_type.nbytes, pred=pred)
        if rm < 63:
            for h in gl.static_range(2):
                _tma_load(desc32, [row, col + h * HALF], bar, smem.index(b + h).slice(0, 32), pred)
                _tma_load(desc32, [row, col + 2 * HALF + h * HALF], bar, smem.index(b + h).slice(32, 32), pred)
        else:
            _copy_pair(desc, smem, b, bar, row, col, pred, HALF)
    else:
        _load_pair(desc, smem, b, bar, row, col, pred, HALF)


@gluon.jit
def _load_tables_split(cos_desc, sin_desc, cos32, sin32, cs_smem, bar, position, pred, rm, PAIR: gl.constexpr):
    """_load_tables, or with PAIR for a pair the 32 rows of its positions into both halves of each
    table tile (the two heads' rows sit at the same positions)."""
    if PAIR:
        mbarrier.expect(bar, 2 * cos_desc.block_type.nbytes, pred=pred)
        if rm < 63:
            for t in gl.static_range(2):
                _tma_load(cos32, [position, 0], bar, cs_smem.index(0).slice(32 * t, 32), pred)
                _tma_load(sin32, [position, 0], bar, cs_smem.index(1).slice(32 * t, 32), pred)
        else:
            _copy_tables(cos_desc, sin_desc, cs_smem, bar, position, pred)
    else:
        _load_tables(cos_desc, sin_desc, cs_smem, bar, position, pred)


@gluon.jit
def _load_tables(cos_desc, sin_desc, cs_smem, bar, position, pred):
    """The cos and sin rows of a block's positions into cs_smem[0], [1], signalling ``bar`` (one
    phase)."""
    mbarrier.expect(bar, 2 * cos_desc.block_type.nbytes, pred=pred)
    _copy_tables(cos_desc, sin_desc, cs_smem, bar, position, pred)


@gluon.jit
def _load_qk(q_desc, k_desc, cos_desc, sin_desc, q_smem, k_smem, cs_smem, bar, row, position, col, pred,
             HALF: gl.constexpr, ROPE: gl.constexpr):
    """q's and k's halves, and with ROPE the cos and sin rows of the block's positions, on one
    barrier: one expect for all of them (an expect is an arrival, and ``bar`` counts one), signalling
    ``bar`` (one phase)."""
    nbytes: gl.constexpr = 4 * q_desc.block_type.nbytes + (2 * cos_desc.block_type.nbytes if ROPE else 0)
    mbarrier.expect(bar, nbytes, pred=pred)
    _copy_pair(q_desc, q_smem, 0, bar, row, col, pred, HALF)
    _copy_pair(k_desc, k_smem, 0, bar, row, col, pred, HALF)
    if ROPE:
        _copy_tables(cos_desc, sin_desc, cs_smem, bar, position, pred)


@gluon.constexpr_function
def _rows_layout(num_warps, cols):
    """16-byte vectors along the rows of a (BS, cols) 16-bit tile: the partial blocks' masked stores."""
    return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 * 8 // cols, cols // 8],
                            warps_per_cta=[num_warps, 1], order=[1, 0])


@gluon.jit
def _rope_rows(cs_smem, layout: gl.constexpr):
    """The block's cos and sin rows (BS, D/2) from shared memory, in ``layout``, in the tables' dtype
    (widened where they are used: held as fp32 next to dq's accumulators they spilled)."""
    return cs_smem.index(0).load(layout), cs_smem.index(1).load(layout)


@gluon.jit
def _rotate_pass(q_smem, qb, k_smem, kb, cs_smem, first, length, BLOCK: gl.constexpr, HALF: gl.constexpr,
                 ROWS: gl.constexpr, MASK: gl.constexpr, num_warps: gl.constexpr, PAIR: gl.constexpr = False, rm=0):
    """_rotate_in_place's pass over the tiles, ROWS rows of q and k at a time; MASK: rows past the
    sequence written as 0."""
    layout: gl.constexpr = _rows_layout(num_warps, HALF)
    for r in gl.static_range(0, BLOCK, ROWS):
        c = cs_smem.index(0).slice(r, ROWS).load(layout).to(gl.float32)
        s = cs_smem.index(1).slice(r, ROWS).load(layout).to(gl.float32)
        q1 = q_smem.index(qb).slice(r, ROWS).load(layout).to(gl.float32)
        q2 = q_smem.index(qb + 1).slice(r, ROWS).load(layout).to(gl.float32)
        k1 = k_smem.index(kb).slice(r, ROWS).load(layout).to(gl.float32)
        k2 = k_smem.index(kb + 1).slice(r, ROWS).load(layout).to(gl.float32)
        y1, y2 = q1 * c - q2 * s, q2 * c + q1 * s
        z1, z2 = k1 * c - k2 * s, k2 * c + k1 * s
        if MASK:  # the next sequence's rows (and their rope rows) may hold non-finite values: selected away
            rows = _row_pos(r + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout)), rm, PAIR)
            ok = (first + rows < length)[:, None]
            y1, y2 = gl.where(ok, y1, 0.0), gl.where(ok, y2, 0.0)
            z1, z2 = gl.where(ok, z1, 0.0), gl.where(ok, z2, 0.0)
        q_smem.index(qb).slice(r, ROWS).store(y1.to(q_smem.dtype))
        k_smem.index(kb).slice(r, ROWS).store(z1.to(k_smem.dtype))
        q_smem.index(qb + 1).slice(r, ROWS).store(y2.to(q_smem.dtype))
        k_smem.index(kb + 1).slice(r, ROWS).store(z2.to(k_smem.dtype))


@gluon.jit
def _rotate_in_place(q_smem, qb, k_smem, kb, cs_smem, first, length, BLOCK: gl.constexpr, HALF: gl.constexpr,
                     ROWS: gl.constexpr, num_warps: gl.constexpr, PAIR: gl.constexpr = False, rm=0):
    """q's halves (q_smem[qb], [qb + 1]) and k's (k_smem[kb], [kb + 1]) rotated in place by the
    rows' cos and sin (cs_smem[0], [1]): [x1, x2] -> [x1 c - x2 s, x2 c + x1 s], ROWS rows of both
    per pass (each pass reads the tables' rows once); rows past the sequence are written as 0, by
    selects compiled into a partial block's pass only (a whole block's pass has none: 128 fewer
    per thread). Both together take ~600 SASS instructions against ~1,000 for the two masked
    passes they replace (sm_90, Triton 3.6, D=128). The whole tile at once spilled 60 B per
    thread."""
    if first + BLOCK > length:
        _rotate_pass(q_smem, qb, k_smem, kb, cs_smem, first, length, BLOCK, HALF, ROWS, True, num_warps, PAIR, rm)
    else:
        _rotate_pass(q_smem, qb, k_smem, kb, cs_smem, first, length, BLOCK, HALF, ROWS, False, num_warps)


@gluon.jit
def _zero_rows_past(smem, b, first, length, BLOCK: gl.constexpr, HALF: gl.constexpr, ROWS: gl.constexpr,
                    num_warps: gl.constexpr, PAIR: gl.constexpr = False, rm=0):
    """Rows at or past ``length`` of both halves in smem[b], smem[b + 1] set to 0 (a partial block's TMA
    boxes hold the next sequence's rows there): then 0 * a non-finite value in them cannot reach
    the gradients through the MMAs, as the Triton kernels' masked loads guarantee. The caller
    fences and syncs before an MMA reads the tiles."""
    layout: gl.constexpr = _rows_layout(num_warps, HALF)
    for i in gl.static_range(2):
        for r in gl.static_range(0, BLOCK, ROWS):
            rows = _row_pos(r + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout)), rm, PAIR)
            ok = (first + rows < length)[:, None]
            x = smem.index(b + i).slice(r, ROWS).load(layout)
            smem.index(b + i).slice(r, ROWS).store(gl.where(ok, x, gl.zeros_like(x)))


@gluon.jit
def _store_pair(g1, g2, desc, tiles, b, DST, start, first, length, col, stride, BLOCK: gl.constexpr,
                HALF: gl.constexpr, num_warps: gl.constexpr, PAIR: gl.constexpr = False, rm=0, sh=0):
    """A gradient's (BS, D/2) halves staged in tiles[b], tiles[b + 1] (free: the caller waited for
    what read them last) and stored: by TMA when the block is whole (one bulk group each), else by
    masked 16-byte stores of the rows read back (then fenced: the tiles' next writer is TMA)."""
    _cta_barrier()  # every warp is past the MMAs that read the tiles
    tiles.index(b).store(g1.to(desc.dtype))
    tiles.index(b + 1).store(g2.to(desc.dtype))
    if first + BLOCK <= length:
        fence_async_shared()
        _cta_barrier()  # every warp's rows are in the tiles before one thread starts the copies
        _tma_store(desc, [start + first, col], tiles.index(b))
        _tma_store(desc, [start + first, col + HALF], tiles.index(b + 1))
    else:
        layout: gl.constexpr = _rows_layout(num_warps, HALF)
        _cta_barrier()
        i = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
        rows = first + _row_pos(i, rm, PAIR)
        cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
        heads = col + _row_head(i, sh, PAIR) * (2 * HALF)  # the tile row's head column
        ptrs = DST + (start + rows).to(gl.int64)[:, None] * stride + heads[:, None] + cols[None, :]
        for h in gl.static_range(2):
            gl.store(ptrs + h * HALF, tiles.index(b + h).load(layout), mask=(rows < length)[:, None])
        fence_async_shared()


@gluon.jit
def _store_rotated_back(g1, g2, c, s, desc, tiles, b, DST, start, first, length, col, stride, scale,
                        ROPE: gl.constexpr, BLOCK: gl.constexpr, HALF: gl.constexpr, num_warps: gl.constexpr,
                        PAIR: gl.constexpr = False, rm=0, sh=0):
    """dq or dk: the halves times ``scale``, rotated by -theta when ROPE ([g1 c + g2 s, g2 c - g1 s]),
    stored through tiles[b], tiles[b + 1] (_store_pair)."""
    g1, g2 = g1 * scale, g2 * scale
    if ROPE:
        c, s = c.to(gl.float32), s.to(gl.float32)
        g1, g2 = g1 * c + g2 * s, g2 * c - g1 * s
    _store_pair(g1, g2, desc, tiles, b, DST, start, first, length, col, stride, BLOCK, HALF, num_warps, PAIR, rm, sh)


@gluon.jit
def _lse_rows(LSE, start, first, length, head, num_heads, BLOCK: gl.constexpr, layout: gl.constexpr,
              PAIR: gl.constexpr = False, rm=0, sh=0):
    """The block's rows of the forward's log2-sum-exp2 (inf past the sequence: p = 0 there)."""
    i = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
    rows = first + _row_pos(i, rm, PAIR)
    return gl.load(LSE + (start + rows) * num_heads + head + _row_head(i, sh, PAIR), mask=rows < length,
                   other=float("inf"))


@gluon.jit
def _first_item(q_desc, k_desc, v_desc, cos_desc, sin_desc, q_smem, k_smem, v_smem, cs_smem, qk_bar, v_bar, n_items,
                RECORDS, num_heads, BLOCK: gl.constexpr, HALF: gl.constexpr, ROPE: gl.constexpr):
    """The forward's first item (_item's fields), its q, k, rope rows and v loads started."""
    valid, start, length, first, col = _item(gl.program_id(0), n_items, _record(gl.program_id(0), n_items, RECORDS,
                                             num_heads), num_heads, BLOCK, HALF)
    _load_qk(q_desc, k_desc, cos_desc, sin_desc, q_smem, k_smem, cs_smem, qk_bar, start + first, first, col, valid,
             HALF, ROPE)
    _load_pair(v_desc, v_smem, 0, v_bar, start + first, col, valid, HALF)
    return valid, start, length, first, col


@gluon.jit
def _scores_of(q_smem, qb, k_smem, kb, cs_smem, first, length, s_zero, BLOCK: gl.constexpr, HALF: gl.constexpr,
               ROPE: gl.constexpr, ZERO_PAST: gl.constexpr, num_warps: gl.constexpr, PAIR: gl.constexpr = False, rm=0):
    """With q (q_smem[qb], [qb + 1]) and k (k_smem[kb], [kb + 1]) landed: q~ and k~ in place of them
    (ROPE; rows past the sequence 0, and with ZERO_PAST also without rope), then s = q~ k~^T by two
    wgmma of depth D/2 (raw: unscaled)."""
    if ROPE:
        _rotate_in_place(q_smem, qb, k_smem, kb, cs_smem, first, length, BLOCK, HALF, 32, num_warps, PAIR, rm)
        fence_async_shared()
        _cta_barrier()
    elif ZERO_PAST:
        if first + BLOCK > length:
            _zero_rows_past(q_smem, qb, first, length, BLOCK, HALF, 32, num_warps, PAIR, rm)
            _zero_rows_past(k_smem, kb, first, length, BLOCK, HALF, 32, num_warps, PAIR, rm)
            fence_async_shared()
            _cta_barrier()
    sc = warpgroup_mma(q_smem.index(qb), k_smem.index(kb).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    sc = warpgroup_mma(q_smem.index(qb + 1), k_smem.index(kb + 1).permute((1, 0)), sc, is_async=True)
    return warpgroup_mma_wait(0, deps=(sc, ))


@gluon.jit
def _bwd_item(e, n_items, n_single, record, num_heads, BLOCK: gl.constexpr, HALF: gl.constexpr, PAIR: gl.constexpr):
    """The backward's item e: _item's fields, then the row mask and head shift of _pair_item (without
    PAIR every item is one head: BLOCK - 1 and 6, which the helpers do not read then)."""
    if PAIR:
        return _pair_item(e, n_items, n_single, record, num_heads, BLOCK, HALF)
    valid, start, length, first, col = _item(e, n_items, record, num_heads, BLOCK, HALF)
    return valid, start, length, first, col, e * 0 + (BLOCK - 1), e * 0 + 6


@gluon.jit
def _key_mask(first, length, rm, sh, BLOCK: gl.constexpr, layout: gl.constexpr, PAIR: gl.constexpr):
    """(BS, BS) scores kept: keys inside the sequence, and with PAIR of the query row's own head."""
    keys = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, layout))
    ok = (first + _row_pos(keys, rm, PAIR) < length)[None, :]
    if PAIR:
        rows = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
        ok = ok & (_row_head(rows, sh, PAIR)[:, None] == _row_head(keys, sh, PAIR)[None, :])
    return ok


@gluon.jit(do_not_specialize=["n_items", "zero", "n_single"])  # per-batch counts: one compile
def _block_attn_bwd_hopper(
    q_desc, k_desc, v_desc, do_desc, dq_desc, dk_desc, dv_desc, cos_desc, sin_desc, DQ, DK, DV, LSE, RECORDS,
    n_items, num_heads, stride_dqn, stride_dkn, stride_dvn, qk_scale, scale, zero,
    q32_desc, k32_desc, v32_desc, do32_desc, cos32_desc, sin32_desc, n_single,
    HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, ROPE: gl.constexpr, num_warps: gl.constexpr,
    PAIR: gl.constexpr = False,
):
    # PAIR: the blocks of at most BLOCK / 2 rows come last in RECORDS (paired_records), each as
    # num_heads / 2 items of two adjacent heads, one head's rows in each half of every tile (its
    # 32-row boxes: *32_desc); items below n_single are (block, head) as without PAIR. A pair's
    # scores across its two heads are masked like keys past the sequence. Without PAIR the *32
    # descriptors and n_single are placeholders.
    # *_desc: [N, H * D] views in (BLOCK, D/2) boxes (host: descriptors); DQ/DK/DV the same tensors
    # for the partial blocks' masked stores; LSE fp32 [N, H] (log2 units); cos_desc/sin_desc: the
    # rope tables [>= max_len, D/2] in (BLOCK, D/2) boxes (unused unless ROPE); RECORDS int32 [n, 8]
    # (common.query_records: sequence, block, the sequence's span) over every block; item e = record
    # index * num_heads + head. zero: 0 (the host passes it; see `z` in the loop).
    #
    # Tiles (each a pair of (BS, D/2) halves): two for q (this item's and the next one's), two that
    # k and v share with roles swapping each item, one for do. In round r, q is in q_smem[qb], k in
    # kv_smem[kb], v in kv_smem[vb] (qb = kb = 2 (r % 2), vb = 2 - kb). The next item's loads start
    # as soon as a tile is free: its q after this item's scores (into the other q tile: a whole
    # item ahead), its k once dp's MMA has read v (into v's tile), its do once dv's stores have
    # read do's tile (before dq's MMAs are issued), its v once dq's MMA has read k (into k's tile),
    # its rope rows once dq's stores have read their tiles (while dk's MMAs run). The gradients are
    # staged in tiles read by then: dv in do's, dq in the rope rows' (dq_tiles; there without rope
    # too), dk in q's.
    HALF: gl.constexpr = HEAD_DIM // 2
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = _acc_layout(num_warps, BLOCK)  # s, dp: (queries, keys)
    h_layout: gl.constexpr = _acc_layout(num_warps, HALF)  # dv, dq, dk halves; the rotation's tiles
    p_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], dtype)

    q_smem = gl.allocate_shared_memory(dtype, [4, BLOCK, HALF], q_desc.layout)
    kv_smem = gl.allocate_shared_memory(dtype, [4, BLOCK, HALF], k_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, BLOCK, HALF], do_desc.layout)
    p_buf = gl.allocate_shared_memory(dtype, [1, BLOCK, BLOCK], p_shared)  # p, then ds
    cs_smem = gl.allocate_shared_memory(cos_desc.dtype, [2, BLOCK, HALF], cos_desc.layout)  # cos, sin rows
    if _PUBLIC_REINTERPRET:  # dq's staging: the tables' tiles (as wide as the inputs or wider)
        dq_tiles = cs_smem.reinterpret(dtype, [2, BLOCK, HALF], dq_desc.layout)
    else:
        dq_tiles = cs_smem._reinterpret(dtype, [2, BLOCK, HALF], dq_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    do_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    cs_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(k_bar, count=1)
    mbarrier.init(v_bar, count=1)
    mbarrier.init(do_bar, count=1)
    mbarrier.init(cs_bar, count=1)
    s_zero = gl.zeros([BLOCK, BLOCK], gl.float32, s_layout)
    h_zero = gl.zeros([BLOCK, HALF], gl.float32, h_layout)

    pid = gl.program_id(0)
    n_programs = gl.num_programs(0)
    valid, start, length, first, col, rm, sh = _bwd_item(
        pid, n_items, n_single, _record(pid, n_items, RECORDS, num_heads, PAIR, n_single), num_heads, BLOCK, HALF, PAIR)
    _load_pair_split(q_desc, q32_desc, q_smem, 0, q_bar, start + first, col, valid, rm, HALF, PAIR)
    _load_pair_split(k_desc, k32_desc, kv_smem, 0, k_bar, start + first, col, valid, rm, HALF, PAIR)
    if ROPE:
        _load_tables_split(cos_desc, sin_desc, cos32_desc, sin32_desc, cs_smem, cs_bar, first, valid, rm, PAIR)
    _load_pair_split(do_desc, do32_desc, do_smem, 0, do_bar, start + first, col, valid, rm, HALF, PAIR)
    _load_pair_split(v_desc, v32_desc, kv_smem, 2, v_bar, start + first, col, valid, rm, HALF, PAIR)
    lse = _lse_rows(LSE, start, first, length, col // HEAD_DIM, num_heads, BLOCK, s_layout, PAIR, rm, sh)
    n_record = _record(pid + n_programs, n_items, RECORDS, num_heads, PAIR, n_single)
    for r in range(0, gl.cdiv(n_items, n_programs)):
        phase = r & 1
        n_valid, n_start, n_length, n_first, n_col, n_rm, n_sh = _bwd_item(
            pid + (r + 1) * n_programs, n_items, n_single, n_record, num_heads, BLOCK, HALF, PAIR)
        n_record = _record(pid + (r + 2) * n_programs, n_items, RECORDS, num_heads, PAIR, n_single)
        n_lse = _lse_rows(LSE, n_start, n_first, n_length, n_col // HEAD_DIM, num_heads, BLOCK, s_layout, PAIR, n_rm,
                          n_sh)
        if valid:
            # z is 0 at run time (zero is), but the compiler cannot tell: p's shared-memory
            # descriptors are formed here, in the round, in uniform registers, instead of being
            # hoisted out of the loop into vector registers it kept across it (they spilled)
            z = r * zero
            p_smem = p_buf.index(z)
            p_t = p_smem.permute((1, 0))  # (keys, queries): p^T, then ds^T
            qb = 2 * (r % 2)
            kb = qb
            vb = 2 - kb
            n_row = n_start + n_first
            partial = first + BLOCK > length
            mbarrier.wait(q_bar, phase)
            mbarrier.wait(k_bar, phase)
            if ROPE:
                mbarrier.wait(cs_bar, phase)
            sc = _scores_of(q_smem, qb, kv_smem, kb, cs_smem, first, length, s_zero, BLOCK, HALF, ROPE, True,
                            num_warps, PAIR, rm)
            # the next item's q: into the other q tile, which staged the last item's dk
            tma.store_wait(0)
            _cta_barrier()
            _load_pair_split(q_desc, q32_desc, q_smem, 2 - qb, q_bar, n_row, n_col, n_valid, n_rm, HALF, PAIR)
            keys = _key_mask(first, length, rm, sh, BLOCK, s_layout, PAIR)
            p = gl.exp2(sc * qk_scale - lse[:, None])
            p = gl.where(keys, p, 0.0)  # keys past the sequence (and a pair's other head): 0
            p_smem.store(p.to(dtype))
            fence_async_shared()
            _cta_barrier()
            mbarrier.wait(do_bar, phase)
            if partial:  # do's rows past the sequence: 0 before dv's and dp's MMAs read them
                _zero_rows_past(do_smem, 0, first, length, BLOCK, HALF, 32, num_warps, PAIR, rm)
                fence_async_shared()
                _cta_barrier()
            dv1 = warpgroup_mma(p_t, do_smem.index(0), h_zero, use_acc=False, is_async=True)
            dv2 = warpgroup_mma(p_t, do_smem.index(1), h_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_bar, phase)
            dp = warpgroup_mma(do_smem.index(0), kv_smem.index(vb).permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)
            dp = warpgroup_mma(do_smem.index(1), kv_smem.index(vb + 1).permute((1, 0)), dp, is_async=True)
            dv1, dv2, dp = warpgroup_mma_wait(0, deps=(dv1, dv2, dp))
            if partial:  # v's rows past the sequence (not zeroed in shared memory): their dp columns 0
                dp = gl.where(keys, dp, 0.0)
            # v's tile is read: the next item's k loads there; dv is staged in do's tile
            _cta_barrier()
            _load_pair_split(k_desc, k32_desc, kv_smem, vb, k_bar, n_row, n_col, n_valid, n_rm, HALF, PAIR)
            _store_pair(dv1, dv2, dv_desc, do_smem, 0, DV, start, first, length, col, stride_dvn, BLOCK, HALF,
                        num_warps, PAIR, rm, sh)
            delta = gl.sum(p * dp, 1)  # the whole softmax row is in the block
            ds = p * (dp - delta[:, None])
            p_smem.store(ds.to(dtype))  # p's MMAs (dv) are complete
            fence_async_shared()
            tma.store_wait(0)  # dv's stores have read do's tile: the next item's do loads there
            _cta_barrier()
            _load_pair_split(do_desc, do32_desc, do_smem, 0, do_bar, n_row, n_col, n_valid, n_rm, HALF, PAIR)
            dq1 = warpgroup_mma(p_smem, kv_smem.index(kb), h_zero, use_acc=False, is_async=True)
            dq2 = warpgroup_mma(p_smem, kv_smem.index(kb + 1), h_zero, use_acc=False, is_async=True)
            dq1, dq2 = warpgroup_mma_wait(0, deps=(dq1, dq2))
            c, s = 0.0, 0.0
            if ROPE:  # read once for both gradients
                c, s = _rope_rows(cs_smem, h_layout)
            _cta_barrier()  # k's tile is read: the next item's v loads there now
            _load_pair_split(v_desc, v32_desc, kv_smem, kb, v_bar, n_row, n_col, n_valid, n_rm, HALF, PAIR)
            # dq is staged in the rope rows' tiles (read now), not in k's: v, needed early in the next
            # item, does not wait for dq's stores; the rope rows (L2-resident tables) do
            _store_rotated_back(dq1, dq2, c, s, dq_desc, dq_tiles, 0, DQ, start, first, length, col, stride_dqn, scale,
                                ROPE, BLOCK, HALF, num_warps, PAIR, rm, sh)
            # dk's MMAs issued before dq is stored (4 accumulators and the tables live) spilled 268 B per
            # thread with rope (sm_90 ptxas, Triton 3.6, D=128), so they start after it
            dk1 = warpgroup_mma(p_t, q_smem.index(qb), h_zero, use_acc=False, is_async=True)
            dk2 = warpgroup_mma(p_t, q_smem.index(qb + 1), h_zero, use_acc=False, is_async=True)
            if ROPE:
                tma.store_wait(0)  # dq's stores have read the rope rows' tiles: the next item's rows load there
                _cta_barrier()
                _load_tables_split(cos_desc, sin_desc, cos32_desc, sin32_desc, cs_smem, cs_bar, n_first, n_valid, n_rm,
                                   PAIR)
            dk1, dk2 = warpgroup_mma_wait(0, deps=(dk1, dk2))
            _store_rotated_back(dk1, dk2, c, s, dk_desc, q_smem, qb, DK, start, first, length, col, stride_dkn, scale,
                                ROPE, BLOCK, HALF, num_warps, PAIR, rm, sh)
        valid, start, length, first, col, lse, rm, sh = n_valid, n_start, n_length, n_first, n_col, n_lse, n_rm, n_sh
    tma.store_wait(0)
    mbarrier.invalidate(q_bar)
    mbarrier.invalidate(k_bar)
    mbarrier.invalidate(v_bar)
    mbarrier.invalidate(do_bar)
    mbarrier.invalidate(cs_bar)


@gluon.jit(do_not_specialize=["n_items"])
def _block_attn_fwd_hopper(
    q_desc, k_desc, v_desc, o_desc, cos_desc, sin_desc, O, LSE, RECORDS, n_items, num_heads, stride_on, qk_scale,
    HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, ROPE: gl.constexpr, num_warps: gl.constexpr,
):
    # The forward on the backward's plan: per item q, k (and the rope rows) on one mbarrier, v on
    # another; q~ and k~ rotated in shared memory; s = q~ k~^T by wgmma; the softmax in registers
    # (keys past the sequence -inf); o = p v with p as the register operand; o and the rows'
    # log2-sum-exp2 stored. The next item's q, k and rope rows load as soon as s's MMA has read
    # them (during this item's softmax, o and stores), its v once o's stores have read v's tiles.
    HALF: gl.constexpr = HEAD_DIM // 2
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = _acc_layout(num_warps, BLOCK)
    h_layout: gl.constexpr = _acc_layout(num_warps, HALF)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=h_layout, k_width=2)

    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK, HALF], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK, HALF], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK, HALF], v_desc.layout)  # v, then o's staging tiles
    cs_smem = gl.allocate_shared_memory(cos_desc.dtype, [2, BLOCK, HALF], cos_desc.layout)
    qk_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(qk_bar, count=1)
    mbarrier.init(v_bar, count=1)
    s_zero = gl.zeros([BLOCK, BLOCK], gl.float32, s_layout)
    h_zero = gl.zeros([BLOCK, HALF], gl.float32, h_layout)

    pid = gl.program_id(0)
    n_programs = gl.num_programs(0)
    valid, start, length, first, col = _first_item(q_desc, k_desc, v_desc, cos_desc, sin_desc, q_smem, k_smem, v_smem,
                                                   cs_smem, qk_bar, v_bar, n_items, RECORDS, num_heads, BLOCK,
                                                   HALF, ROPE)
    n_record = _record(pid + n_programs, n_items, RECORDS, num_heads)
    for r in range(0, gl.cdiv(n_items, n_programs)):
        phase = r & 1
        n_valid, n_start, n_length, n_first, n_col = _item(pid + (r + 1) * n_programs, n_items, n_record, num_heads,
                                                           BLOCK, HALF)
        n_record = _record(pid + (r + 2) * n_programs, n_items, RECORDS, num_heads)
        if valid:
            partial = first + BLOCK > length
            # without rope q and k rows past the sequence stay: their scores are replaced by -inf
            # (keys) or never stored (queries)
            mbarrier.wait(qk_bar, phase)
            sc = _scores_of(q_smem, 0, k_smem, 0, cs_smem, first, length, s_zero, BLOCK, HALF, ROPE, False, num_warps)
            _cta_barrier()  # q, k and the rope rows are read: the next item's start loading
            _load_qk(q_desc, k_desc, cos_desc, sin_desc, q_smem, k_smem, cs_smem, qk_bar, n_start + n_first, n_first,
                     n_col, n_valid, HALF, ROPE)
            k_cols = first + gl.arange(0, BLOCK, layout=gl.SliceLayout(0, s_layout))
            sc = gl.where((k_cols < length)[None, :], sc * qk_scale, float("-inf"))  # finite: key `first` is valid
            m = gl.max(sc, 1)
            p = gl.exp2(sc - m[:, None])
            l = gl.sum(p, 1)
            q_rows = first + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, s_layout))
            gl.store(LSE + (start + q_rows) * num_heads + col // HEAD_DIM, m + gl.log2(l), mask=q_rows < length)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            inv_l = gl.convert_layout(1.0 / l, gl.SliceLayout(1, h_layout))
            mbarrier.wait(v_bar, phase)
            if partial:  # the next sequence's v rows: p = 0 there, and 0 * a non-finite value is NaN
                _zero_rows_past(v_smem, 0, first, length, BLOCK, HALF, 32, num_warps)
                fence_async_shared()
                _cta_barrier()
            o1 = warpgroup_mma(p_op, v_smem.index(0), h_zero, use_acc=False, is_async=True)
            o2 = warpgroup_mma(p_op, v_smem.index(1), h_zero, use_acc=False, is_async=True)
            o1, o2 = warpgroup_mma_wait(0, deps=(o1, o2))
            # v's tiles, read now, stage o (no staging tiles of its own: 66 KB with fp16 tables at
            # D=128, three programs per SM where 82 KB fit two); the next item's v loads once the
            # stores have read them, well before its softmax needs them
            _store_pair(o1 * inv_l[:, None], o2 * inv_l[:, None], o_desc, v_smem, 0, O, start, first, length, col,
                        stride_on, BLOCK, HALF, num_warps)
            tma.store_wait(0)
            _cta_barrier()
            _load_pair(v_desc, v_smem, 0, v_bar, n_start + n_first, n_col, n_valid, HALF)
        valid, start, length, first, col = n_valid, n_start, n_length, n_first, n_col
    tma.store_wait(0)
    mbarrier.invalidate(qk_bar)
    mbarrier.invalidate(v_bar)


# ----------------------------------------------------------------------------------------------
# Host side.

def tiles_viewable(*tensors) -> bool:
    """Whether [N, H, D] tensors of one 16-bit dtype can be read or written by TMA as [N, H * D] in
    (BLOCK, D/2) boxes (common.rows_viewable)."""
    half = tensors[0].shape[2] // 2
    return (tensors[0].dtype in _GL_DTYPES and all(t.dtype == tensors[0].dtype for t in tensors)
            and all(rows_viewable(t, BLOCK, half) for t in tensors))


def tables_viewable(cos, sin) -> bool:
    """Whether rope tables [rows, D/2] can be read by TMA in (BLOCK, D/2) boxes: fp16/bf16 (what
    rope_table_dtype gives 16-bit inputs) or fp32 (twice the shared memory), one dtype, 16-byte
    aligned rows and bases."""
    if cos.dtype not in ELEMENT_TYPES or cos.dtype != sin.dtype:
        return False
    size = cos.element_size()
    return not any(t.stride(1) != 1 or (t.stride(0) * size) % 16 or t.data_ptr() % 16 or (t.shape[1] * size) % 16
                   for t in (cos, sin))


def descriptors(*tensors, rows: int = BLOCK):
    """TMA descriptors of [N, H, D] tensors as [N, H * D] in (rows, D/2) boxes (the paired backward's
    32-row boxes land in halves of (BLOCK, D/2) tiles, whose layout they take), or None where
    tiles_viewable says no."""
    if not tiles_viewable(*tensors):
        return None
    half = tensors[0].shape[2] // 2
    return [TensorDescriptor(t, [t.shape[0], t.shape[1] * t.shape[2]], [t.stride(0), 1], [rows, half],
                             shared_layout(BLOCK, half, t.dtype)) for t in tensors]


def table_descriptors(cos, sin, rows: int = BLOCK):
    """TMA descriptors of the rope tables in (rows, D/2) boxes, or None where tables_viewable says
    no (fp32 tables: one backward program per SM, resident_programs)."""
    if not tables_viewable(cos, sin):
        return None
    layout = shared_layout(BLOCK, cos.shape[1], cos.dtype)
    return [TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [rows, t.shape[1]], layout) for t in (cos, sin)]


def resident_programs(dim: int, size: int, table_size: int, backward: bool = True) -> int:
    """How many programs of a kernel fit one SM (the backward's registers allow two, the forward's
    three: sm_90 ptxas, Triton 3.6). Shared memory: the backward's ten (BLOCK, D/2) halves (two q
    tiles, two k/v tiles, do's) and p/ds tile, the forward's six halves; both the two rope-row tiles
    (``table_size`` bytes an element, 0 without rope; the backward's stage dq, so they are there
    without rope too, at least as wide as the inputs). A persistent grid larger than what is
    resident would run its second wave only after the first has done all its rounds."""
    tile = BLOCK * dim // 2
    tiles = (10 * tile + BLOCK * BLOCK) if backward else 6 * tile
    if backward:  # the rope rows' tiles stage dq: there without rope too, as wide as the inputs
        table_size = max(table_size, size)
    shared = tiles * size + 2 * tile * table_size + 1024  # + barriers, alignment
    return max(1, min(2 if backward else 3, _SMEM_PER_SM // (shared + _SMEM_RESERVED)))


def _checked(block_size: int, rope: bool, cos, sin, *tensors):
    """(tile descriptors, table descriptors) of a launch over ``tensors`` (q first), or ValueError
    naming what the kernels were not built for (block size, head dim, dtype, a layout without TMA
    descriptors): the autotuner then takes the next candidate, a pinned config raises. Without
    rope the tables' descriptors are placeholders (q's and k's), never read."""
    q = tensors[0]
    dim = q.shape[2]
    if block_size != BLOCK or dim not in (64, 128) or q.dtype not in _GL_DTYPES:
        raise ValueError(f"block_attention (Hopper): block {block_size}, head_dim {dim}, {q.dtype} is not built "
                         f"(block {BLOCK}, head_dim 64/128, bf16/fp16)")
    descs = descriptors(*tensors)
    if descs is None:
        raise ValueError("block_attention (Hopper): the tensors do not allow TMA descriptors (one dtype, heads "
                         "adjacent, 16-byte aligned rows, at least one block of rows)")
    tables = table_descriptors(cos, sin) if rope else descs[:2]
    if tables is None:
        raise ValueError(f"block_attention (Hopper): rope tables of {cos.dtype} with strides {tuple(cos.stride())} "
                         "(16-byte aligned fp16/bf16/fp32 rows needed)")
    return descs, tables


def _grid(n_items: int, q, cos, rope: bool, per_sm: int, backward: bool):
    """The persistent grid of ``n_items`` items: ``per_sm`` programs per SM, at most what fits."""
    per_sm = min(per_sm, resident_programs(q.shape[2], q.element_size(), cos.element_size() if rope else 0, backward))
    return (num_programs(n_items, per_sm, q.device),)


def forward(q, k, v, out, lse, cos, sin, records, block_size: int, rope: bool, qk_scale: float,
            per_sm: int) -> None:
    """Launch the Gluon forward over ``records`` (every block: common.query_records with a tile of
    block_size rows), ``per_sm`` programs per SM (at most what fits); writes ``out`` and ``lse``
    (log2 units, as the Triton forward)."""
    descs, tables = _checked(block_size, rope, cos, sin, q, k, v, out)
    n_items = records.shape[0] * q.shape[1]
    grid = _grid(n_items, q, cos, rope, per_sm, False)
    if n_items:
        _block_attn_fwd_hopper[grid](*descs, *tables, out, lse, records, n_items, q.shape[1], out.stride(0),
                                     qk_scale, HEAD_DIM=q.shape[2], BLOCK=BLOCK, ROPE=bool(rope), num_warps=4)


def backward(q, k, v, do, lse, dq, dk, dv, cos, sin, records, block_size: int, rope: bool, qk_scale: float,
             scale: float, per_sm: int, pair: bool = False, offsets=None) -> None:
    """Launch the Gluon backward over ``records`` (every block, as forward), ``per_sm`` programs per SM
    (at most what fits); ``cos``/``sin`` the rope tables (ignored without ``rope``). ``pair`` (with the
    batch's ``offsets`` and an even number of heads, else ValueError): the blocks of at most BLOCK / 2
    rows run two heads to an item (paired_records, built here: ``records`` may be None then)."""
    descs, tables = _checked(block_size, rope, cos, sin, q, k, v, do, dq, dk, dv)
    heads = q.shape[1]
    if pair:
        if heads % 2 or offsets is None:  # the autotuner then takes the next candidate; a pinned config raises
            given = "given" if offsets is not None else "None"
            raise ValueError(f"block_attention (Hopper): the paired backward takes an even number of heads and the "
                             f"batch's offsets (got {heads} heads, offsets {given})")
        records, n_single_blocks = paired_records(offsets, q.device)
        n_single = n_single_blocks * heads
        n_items = n_single + (records.shape[0] - n_single_blocks) * (heads // 2)
        halves = descriptors(q, k, v, do, rows=BLOCK // 2)
        halves += table_descriptors(cos, sin, rows=BLOCK // 2) if rope else halves[:2]
    else:
        n_single, n_items = 0, records.shape[0] * heads
        halves = descs[:4] + tables  # placeholders, never read
    if n_items:
        _block_attn_bwd_hopper[_grid(n_items, q, cos, rope, per_sm, True)](
            *descs, *tables, dq, dk, dv, lse, records, n_items, heads, dq.stride(0), dk.stride(0), dv.stride(0),
            qk_scale, scale, 0, *halves, n_single, HEAD_DIM=q.shape[2], BLOCK=BLOCK, ROPE=bool(rope), num_warps=4,
            PAIR=pair)


def paired_records(offsets, device):
    """(records, n_single): the blocks (BLOCK rows) with those of more than BLOCK / 2 rows first and
    the others last (common.records_short_last). The paired backward runs each of the first as one
    item per head and each of the others as one item per two heads."""
    return records_short_last(offsets, BLOCK, device)
