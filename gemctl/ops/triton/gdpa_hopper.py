"""GDPA forward for Hopper in Gluon: short key sides (cross-attention) held in shared memory.

out_i = sum_j act(scale * q_i . k_j) v_j, as gemctl.ops.triton.gdpa, for sequences whose keys
all fit one tile (k_len <= BLOCK_N <= 128: GEM's cross-attention over a few non-sequence tokens).

Why a second kernel: the Triton forward of cross-128 stayed at ~49% of its memory roofline on the
H200 (docs/benchmarks.md, gdpa): each program loads its query tile and then its four key tiles
in sequence before the first MMA, and neither more resident warps, register caps, TMA, nor a
flattened persistent loop got Triton 3.6's pipeliner to overlap one item's loads with another's
math. Gluon (Triton's tile-level language with explicit shared memory, TMA, mbarriers and
asynchronous wgmma) states the schedule directly:

- persistent programs, items (sequence, chunk of CHUNK query tiles, head) dealt in zigzag order
  from the host-built work records (common.query_records; no device sync);
- the item's K and V (BLOCK_N x D each) land in shared memory once by TMA and serve every query
  tile of the chunk; LOOKAHEAD = 1 starts the next item's K as soon as the last S MMA has read K,
  and its V after the last O MMA;
- the query tiles of all of a program's items stream through a ring of Q_STAGES shared-memory
  slots, each slot refilled by TMA as soon as its S = Q K^T MMA has read it, with the next item's
  first tiles once the current item's are all started;
- S is an asynchronous wgmma into registers; the activation runs on it there and P goes to the
  second wgmma (O = P V) as a register operand: P never touches shared memory;
- whole output tiles leave through shared memory and a TMA store; the last, partial tile of a
  sequence by masked stores (a TMA box would write into the next sequence's rows).

Keys past k_len (the next sequence's rows, or TMA's zero fill at the tensor's end) are masked to
s = 0, and act(0) = 0 for both activations, so they contribute nothing (their V rows are multiplied
by P = 0, not masked: a non-finite value in the next sequence's V would reach this output). The
activation is gdpa._fwd_act's: on the raw score, the scale folded into its constants. Query rows
past q_len are computed and never stored.

Measured (H200, Triton 3.6, 2026-12-03, docs/benchmarks.md): cross-128 forward 85 us against 127 us
for the best Triton config, 70% of its roofline against 47%; cross-32 63 us against 58 us for
Triton's resident-key config, which autotuning keeps there. Tried and dropped: the next tile's S
MMA issued before this tile's activation (255 registers, 5% slower). One warpgroup per program:
with two, one warpgroup's refill of a slot could complete that slot's next phase before the other
has waited on the current one.

A streaming twin for key sides of any length (self-attention: the keys of a program's items as
one stream through a (K, V) ring) ran on the H200 on 2026-12-04: 3% slower than Triton's tile loop
on self-1000 with 2 slots of 64 keys, wrong with 3 slots or 128-key tiles, and it hung the GPU on
the every-candidate test's shapes (fewer items than a persistent grid's programs, 32-key sides).
It was removed (docs/benchmarks.md, gdpa). So was a resident form storing its output straight
from the accumulator's registers (no staging tile, a third query slot): 119 us on cross-128
against 85 us through shared memory and TMA.

A warp-specialized form of the resident kernel (_gdpa_fwd_ws: one program per SM, a loader warp
and two consumer warpgroups sharing each item's K and V, the next item's K and V double-buffered)
was built on 2026-12-04 for cross-128's missing 10 points, with a streaming twin for key sides of
any length (_gdpa_fwd_ws_stream: a pair of query tiles per item, the keys through a ring of (K, V)
tiles both consumers read) for self-1000. Both passed the GPU tier (H100, 2026-12-05) and are
autotuned: the H200 picks the first for cross-128 (72% of its roofline) and the second for
self-1000 (15% less time than the softmax forward). A ping-pong option for the first (its consumers
taking turns at the tensor cores, FlashAttention 3's schedule) was measured and removed: 85.9
against 84.2 us on cross-128 (H200), no faster on the H100 (docs/benchmarks.md).

Every item is read from a host-resolved record (common.query_records: tile, query span, key
span), so no load of an item waits for another's result (the work list and then the offsets did:
14% of the cross-128 forward's warp-stall samples, Nsight Compute on an H100, 2026-12-05).

Supported: bf16/fp16, D in {64, 128}, heads adjacent in memory (q/k/v/out as [N, H * D] rows
with 16-byte aligned strides, at least one box of rows), sm_90+. No interpreter: the CPU tier
compiles it for sm_90 (scripts/check_kernels_build.py) and the GPU tier checks it against float64
(tests/test_gdpa_triton.py, test_gdpa_hopper_forward_gpu).
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from gemctl.ops.triton.common import config_field, num_programs, rows_viewable, work_record

# Triton 3.6 names the TMA copies async_copy_global_to_shared / async_copy_shared_to_global; later
# releases renamed them async_load / async_store (the old names raise there).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed after 3.6 too
# the forwards' activation, shared with the Triton kernels (plain Triton functions compile in a Gluon
# kernel on its tiles' layouts)
from gemctl.ops.triton.gdpa import _fwd_act, _act_consts, _fwd_out


@gluon.constexpr_function
def _acc_layout(num_warps, cols):
    """The register layout of a wgmma accumulator with `cols` columns, one warpgroup's rows."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, cols, 16])


@gluon.jit
def _scores(s, k_len, ac, s_layout: gl.constexpr, BLOCK_N: gl.constexpr, ACT: gl.constexpr, FOLD: gl.constexpr,
            dtype: gl.constexpr, p_layout: gl.constexpr):
    """_fwd_act(s) with keys >= k_len masked to s = 0 (act(0) = 0), as the second MMA's A operand."""
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s = gl.where((cols < k_len)[None, :], s, 0.0)
    return gl.convert_layout(_fwd_act(s, ac, ACT, FOLD).to(dtype), p_layout)


@gluon.jit
def _item(r, pid, n_programs, n_items, RECORDS, num_heads, CHUNK: gl.constexpr,
          BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Round r's item of program pid (zigzag, common.zigzag_item): the sequence's query span, the
    first row of the chunk (m0), the key span, the column of its head in the [N, H * D] views, and
    how many query tiles it has (0 past the last item). From its record (common.query_records): no
    load waits on another's result."""
    e = r * n_programs + gl.where(r % 2 == 0, pid, n_programs - 1 - pid)
    valid = e < n_items
    e = gl.minimum(e, n_items - 1)  # no read past the work list for rounds beyond it
    chunk, q_start, q_len, k_start, k_len = work_record(RECORDS, e // num_heads)
    m0 = chunk * (CHUNK * BLOCK_M)
    n_tiles = gl.where(valid, gl.minimum(gl.cdiv(q_len - m0, BLOCK_M), CHUNK), 0)
    return q_start, q_len, m0, k_start, k_len, (e % num_heads) * HEAD_DIM, n_tiles


@gluon.jit
def _load_q(q_desc, q_smem, q_bars, slot, row, col, pred):
    bar = q_bars.index(slot)
    mbarrier.expect(bar, q_desc.block_type.nbytes, pred=pred)
    _tma_load(q_desc, [row, col], bar, q_smem.index(slot), pred)


@gluon.jit
def _tile_offset(i, BLOCK_M: gl.constexpr, PROBE: gl.constexpr):
    """Row offset of an item's query tile i within its chunk (PROBE 2: always the first tile's)."""
    if PROBE == 2:
        return i * 0
    return i * BLOCK_M


@gluon.jit
def _load_kv(desc, smem, bar, row, col, pred):
    mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
    _tma_load(desc, [row, col], bar, smem, pred)


@gluon.jit
def _store_rows(o, O, q_start, row0, q_len, col, stride_on, o_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                HEAD_DIM: gl.constexpr):
    """Rows [row0, row0 + BLOCK_M) of the sequence's output by masked stores from the accumulator's layout."""
    rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    ptrs = O + (q_start + rows).to(gl.int64)[:, None] * stride_on + col + dims[None, :]
    gl.store(ptrs, o.to(O.dtype.element_ty), mask=(rows < q_len)[:, None])


@gluon.jit
def _store_o(o, o_desc, o_smem, O, q_start, row0, q_len, col, stride_on, o_layout: gl.constexpr,
             BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Rows [row0, row0 + BLOCK_M) of the sequence's output: by TMA when the tile is whole, else
    by masked stores straight from the accumulator's layout."""
    out = o.to(o_desc.dtype)
    if row0 + BLOCK_M <= q_len:
        tma.store_wait(0)  # the previous tile's store has read o_smem
        _cta_barrier()
        o_smem.store(out)
        fence_async_shared()
        _cta_barrier()  # every warp's rows are in o_smem before one thread starts the copy
        _tma_store(o_desc, [q_start + row0, col], o_smem)
    else:
        _store_rows(o, O, q_start, row0, q_len, col, stride_on, o_layout, BLOCK_M, HEAD_DIM)


@gluon.jit(do_not_specialize=["n_items"])
def _gdpa_fwd_resident(
    q_desc, k_desc, v_desc, o_desc, O, RECORDS, n_items, num_heads, stride_on, scale,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CHUNK: gl.constexpr, ACT: gl.constexpr,
    Q_STAGES: gl.constexpr, LOOKAHEAD: gl.constexpr, FOLD: gl.constexpr, num_warps: gl.constexpr,
    PROBE: gl.constexpr = 0,
):
    # PROBE (benchmarks only, wrong outputs by design; forward() refuses it unless PROBES is set):
    # 1 = the memory pipeline alone (every load, wait and store, no MMA or activation: zeros
    # stored); 2 = the math alone (each item's query tiles all read from, and written to, its first
    # tile's rows, which stay in L2, so HBM moves K and V only).
    #
    # q_desc / o_desc: [Nq, H * D] in (BLOCK_M, D) boxes; k_desc / v_desc: [Nk, H * D] in
    # (BLOCK_N, D) boxes (host: gdpa_hopper.descriptors). RECORDS: common.query_records, int32 [n, 8]
    # (sequence, chunk of CHUNK query tiles, query span, key span); item e = record index * num_heads
    # + head, dealt in zigzag rounds (_item).
    #
    # The query tiles of a program's items form one stream through the Q_STAGES-slot ring:
    # `issued` loads have been started into slots issued % Q_STAGES, `consumed` tiles read by their
    # S MMA; each consumed slot is refilled at once with the next tile of the stream, the current
    # item's or else the next item's (so the next item's first tiles are in flight while this one
    # finishes). LOOKAHEAD = 1 also starts the next item's K as soon as this item's last S MMA has
    # read K, and its V after the last O MMA; 0 loads them after the item.
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = _acc_layout(num_warps, BLOCK_N)  # S = Q K^T
    o_layout: gl.constexpr = _acc_layout(num_warps, HEAD_DIM)  # O = P V
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)  # P in registers

    q_smem = gl.allocate_shared_memory(dtype, [Q_STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
    o_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], o_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [Q_STAGES, 1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_STAGES):
        mbarrier.init(q_bars.index(i), count=1)
    mbarrier.init(k_bar, count=1)
    mbarrier.init(v_bar, count=1)
    k_t = k_smem.permute((1, 0))  # (D, BLOCK_N): the B operand of S = Q K^T
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    o_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

    pid = gl.program_id(0)
    ac = _act_consts(scale, FOLD)
    n_programs = gl.num_programs(0)
    q_start, q_len, m0, k_start, k_len, col, n_tiles = _item(0, pid, n_programs, n_items, RECORDS,
                                                             num_heads, CHUNK, BLOCK_M, HEAD_DIM)
    _load_kv(k_desc, k_smem, k_bar, k_start, col, n_tiles > 0)
    _load_kv(v_desc, v_smem, v_bar, k_start, col, n_tiles > 0)
    issued = 0  # loads started (stream position)
    consumed = 0  # tiles read by their S MMA
    mine = 0  # the current item's tiles among the loads started
    for i in gl.static_range(Q_STAGES):
        _load_q(q_desc, q_smem, q_bars, i, q_start + m0 + _tile_offset(i, BLOCK_M, PROBE), col, i < n_tiles)
        issued += (i < n_tiles).to(gl.int32)
        mine += (i < n_tiles).to(gl.int32)
    kv_phase = 0
    for r in range(0, gl.cdiv(n_items, n_programs)):
        nq_start, nq_len, nm0, nk_start, nk_len, ncol, nn_tiles = _item(
            r + 1, pid, n_programs, n_items, RECORDS, num_heads, CHUNK, BLOCK_M, HEAD_DIM)
        theirs = 0  # the next item's tiles among the loads started
        if n_tiles > 0:
            mbarrier.wait(k_bar, kv_phase)
            for t in range(0, n_tiles):
                slot = consumed % Q_STAGES
                mbarrier.wait(q_bars.index(slot), (consumed // Q_STAGES) & 1)
                if PROBE != 1:
                    s = warpgroup_mma(q_smem.index(slot), k_t, s_zero, use_acc=False, is_async=True)
                    s = warpgroup_mma_wait(0, deps=(s, ))
                consumed += 1
                # start the stream's next load (the current item's next tile, else the next item's)
                # in slot issued % Q_STAGES, which the ring's invariant keeps free here (it is the
                # slot just consumed only while the ring was full)
                cur = mine < n_tiles
                nxt = (not cur) & (theirs < nn_tiles)
                row = gl.where(cur, q_start + m0 + _tile_offset(mine, BLOCK_M, PROBE),
                               nq_start + nm0 + _tile_offset(theirs, BLOCK_M, PROBE))
                _load_q(q_desc, q_smem, q_bars, issued % Q_STAGES, row, gl.where(cur, col, ncol), cur | nxt)
                issued += (cur | nxt).to(gl.int32)
                mine += cur.to(gl.int32)
                theirs += nxt.to(gl.int32)
                last = t == n_tiles - 1
                if LOOKAHEAD:
                    _load_kv(k_desc, k_smem, k_bar, nk_start, ncol, last & (nn_tiles > 0))
                if PROBE == 1:
                    mbarrier.wait(v_bar, kv_phase, pred=t == 0)
                    o = o_zero
                else:
                    p = _scores(s, k_len, ac, s_layout, BLOCK_N, ACT, FOLD, dtype, p_layout)
                    mbarrier.wait(v_bar, kv_phase, pred=t == 0)
                    o = warpgroup_mma(p, v_smem, o_zero, use_acc=False, is_async=True)
                    o = warpgroup_mma_wait(0, deps=(o, ))
                if LOOKAHEAD:
                    _load_kv(v_desc, v_smem, v_bar, nk_start, ncol, last & (nn_tiles > 0))
                _store_o(_fwd_out(o, ac, ACT), o_desc, o_smem, O, q_start, m0 + _tile_offset(t, BLOCK_M, PROBE), q_len,
                         col, stride_on, o_layout, BLOCK_M, HEAD_DIM)
            kv_phase ^= 1
            if not LOOKAHEAD:
                _load_kv(k_desc, k_smem, k_bar, nk_start, ncol, nn_tiles > 0)
                _load_kv(v_desc, v_smem, v_bar, nk_start, ncol, nn_tiles > 0)
        q_start, q_len, m0, k_start, k_len, col, n_tiles = nq_start, nq_len, nm0, nk_start, nk_len, ncol, nn_tiles
        mine = theirs
        for i in gl.static_range(Q_STAGES):  # top the ring up (the last item may have freed fewer slots)
            more = (issued - consumed < Q_STAGES) & (mine < n_tiles)
            _load_q(q_desc, q_smem, q_bars, issued % Q_STAGES, q_start + m0 + _tile_offset(mine, BLOCK_M, PROBE), col,
                    more)
            issued += more.to(gl.int32)
            mine += more.to(gl.int32)
    tma.store_wait(0)
    for i in gl.static_range(Q_STAGES):
        mbarrier.invalidate(q_bars.index(i))
    mbarrier.invalidate(k_bar)
    mbarrier.invalidate(v_bar)


# ----------------------------------------------------------------------------------------------
# The warp-specialized form: one program per SM, a loader warp and two consumer warpgroups.
#
# The resident kernel above runs loads, MMAs, the activation and stores in one warpgroup, in the
# order of its code: a query slot is refilled only when that warpgroup reaches the refill, K and V
# of the next item only after this item's last tile, and the two programs of an SM hold two items'
# K and V (64 KB each at 128 keys, D = 128) in shared memory. Here the roles are split:
# - a loader warp walks the program's items and issues every TMA load as soon as its buffer is free
#   (`*_empty` barriers), independent of the consumers' progress;
# - two consumer warpgroups take the stream's query tiles alternately (tile g to warpgroup g % 2),
#   sharing the item's K and V, each with its own output staging tile; one's activation overlaps
#   the other's MMAs, as two programs per SM do, without a second copy of K and V;
# - KV_STAGES = 2 buffers hold the next item's K and V while this item's tiles run (no bubble at an
#   item boundary); 1 leaves room for more query slots.
# Every partition walks the same item list (_item) and so agrees on tile and buffer numbers without
# talking: tile g is in slot g % Q_STAGES at phase (g // Q_STAGES) & 1, item j (counting items with
# tiles) in K/V buffer j % KV_STAGES. A buffer is released by one arrival per consumer (kv_empty
# counts two), made after the consumer's last MMA on it, or, for a consumer with no tile in the item
# (an item of one tile), after waiting for the buffer to be filled: so a consumer never releases a
# buffer twice before it has been refilled.

@gluon.constexpr_function
def _p_layout(o_layout):
    """P = act(S) as the register A operand of O = P V."""
    return gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)


@gluon.jit
def _consumer_start(scale, s_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, FOLD: gl.constexpr):
    """A warp-specialized consumer's constants: zero S and O tiles, the activation's constants,
    its program and the grid's size."""
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    o_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    return s_zero, o_zero, _act_consts(scale, FOLD), gl.program_id(0), gl.num_programs(0)


@gluon.jit
def _ws_barriers(Q_SLOTS: gl.constexpr, KV_STAGES: gl.constexpr):
    """The warp-specialized kernels' mbarriers: ready (a TMA fill landed) and empty (its readers are
    done) per query slot and per (K, V) slot; a (K, V) slot's empty counts one arrival per consumer."""
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_SLOTS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    for i in gl.static_range(KV_STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)
    return q_ready, q_empty, kv_ready, kv_empty


@gluon.jit
def _ws_load_q(q_desc, q_smem, q_ready, q_empty, g, row, col, Q_STAGES: gl.constexpr):
    """Stream tile g into slot g % Q_STAGES once that slot's previous tile (g - Q_STAGES) is read."""
    slot = g % Q_STAGES
    mbarrier.wait(q_empty.index(slot), ((g // Q_STAGES) & 1) ^ 1)  # a fresh barrier: the first pass goes at once
    _load_q(q_desc, q_smem, q_ready, slot, row, col, True)


@gluon.jit
def _ws_loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty, RECORDS,
               n_items, num_heads, CHUNK: gl.constexpr, BLOCK_M: gl.constexpr,
               HEAD_DIM: gl.constexpr, Q_STAGES: gl.constexpr, KV_STAGES: gl.constexpr, PROBE: gl.constexpr = 0):
    pid = gl.program_id(0)
    n_programs = gl.num_programs(0)
    g = 0  # query tiles loaded
    j = 0  # items (with tiles) whose K and V are loaded
    for r in range(0, gl.cdiv(n_items, n_programs)):
        q_start, q_len, m0, k_start, k_len, col, n_tiles = _item(r, pid, n_programs, n_items, RECORDS, num_heads,
                                                                 CHUNK, BLOCK_M, HEAD_DIM)
        if n_tiles > 0:
            # With one K/V buffer, the item's first tiles go before its K and V, whose buffer frees
            # only when this program's previous item is done: a slot those tiles wait for holds a
            # tile of an earlier item (at most Q_STAGES of them), so the wait cannot need this item's
            # K and V. With two, K and V go first: they are what the item's first tile waits for.
            early = 0
            if KV_STAGES == 1:
                early = gl.minimum(n_tiles, Q_STAGES)
                for t in range(0, early):
                    _ws_load_q(q_desc, q_smem, q_ready, q_empty, g + t, q_start + m0 + _tile_offset(t, BLOCK_M, PROBE),
                               col, Q_STAGES)
            buf = j % KV_STAGES
            mbarrier.wait(kv_empty.index(buf), ((j // KV_STAGES) & 1) ^ 1)
            bar = kv_ready.index(buf)
            mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            _tma_load(k_desc, [k_start, col], bar, k_smem.index(buf))
            _tma_load(v_desc, [k_start, col], bar, v_smem.index(buf))
            j += 1
            for t in range(early, n_tiles):
                _ws_load_q(q_desc, q_smem, q_ready, q_empty, g + t, q_start + m0 + _tile_offset(t, BLOCK_M, PROBE), col,
                           Q_STAGES)
            g += n_tiles


@gluon.jit
def _ws_consumer(me: gl.constexpr, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, kv_ready, kv_empty,
                 o_desc, O, RECORDS, n_items, num_heads, stride_on, scale, HEAD_DIM: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CHUNK: gl.constexpr, ACT: gl.constexpr,
                 FOLD: gl.constexpr, Q_STAGES: gl.constexpr, KV_STAGES: gl.constexpr, PROBE: gl.constexpr = 0):
    """Consumer warpgroup ``me`` (0 or 1): the tiles g with g % 2 == me of the program's stream.
    Q_STAGES is even, so a slot only ever holds one consumer's tiles: a consumer waiting on a slot
    is never more than one phase behind it (with an odd count it could pass on the other
    consumer's previous phase)."""
    gl.static_assert(Q_STAGES % 2 == 0, "the warp-specialized GDPA forward needs an even number of query slots")
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _acc_layout(4, BLOCK_N)
    o_layout: gl.constexpr = _acc_layout(4, HEAD_DIM)
    p_layout: gl.constexpr = _p_layout(o_layout)
    s_zero, o_zero, ac, pid, n_programs = _consumer_start(scale, s_layout, o_layout, BLOCK_M, BLOCK_N, HEAD_DIM, FOLD)
    g = 0  # the stream position of the current item's first tile
    j = 0
    q_start, q_len, m0, k_start, k_len, col, n_tiles = _item(0, pid, n_programs, n_items, RECORDS,
                                                             num_heads, CHUNK, BLOCK_M, HEAD_DIM)
    for r in range(0, gl.cdiv(n_items, n_programs)):
        # the next round's item, read now: its loads' latency passes during this item's tiles
        nq_start, nq_len, nm0, nk_start, nk_len, ncol, nn_tiles = _item(
            r + 1, pid, n_programs, n_items, RECORDS, num_heads, CHUNK, BLOCK_M, HEAD_DIM)
        if n_tiles > 0:
            buf = j % KV_STAGES
            mbarrier.wait(kv_ready.index(buf), (j // KV_STAGES) & 1)
            k_t = k_smem.index(buf).permute((1, 0))
            v_buf = v_smem.index(buf)
            for t in range((g + me) % 2, n_tiles, 2):  # my tiles: (g + t) % 2 == me
                slot = (g + t) % Q_STAGES
                mbarrier.wait(q_ready.index(slot), ((g + t) // Q_STAGES) & 1)
                if PROBE == 1:  # the memory pipeline alone: no MMA, no activation, zeros stored
                    mbarrier.arrive(q_empty.index(slot), count=1)
                    o = o_zero
                else:
                    s = warpgroup_mma(q_smem.index(slot), k_t, s_zero, use_acc=False, is_async=True)
                    s = warpgroup_mma_wait(0, deps=(s, ))
                    mbarrier.arrive(q_empty.index(slot), count=1)  # the S MMA has read the slot
                    p = _scores(s, k_len, ac, s_layout, BLOCK_N, ACT, FOLD, dtype, p_layout)
                    o = warpgroup_mma(p, v_buf, o_zero, use_acc=False, is_async=True)
                    o = warpgroup_mma_wait(0, deps=(o, ))
                _store_o(_fwd_out(o, ac, ACT), o_desc, o_smem, O, q_start, m0 + _tile_offset(t, BLOCK_M, PROBE), q_len,
                         col, stride_on, o_layout, BLOCK_M, HEAD_DIM)
            mbarrier.arrive(kv_empty.index(buf), count=1)  # after my last MMA on this buffer (or its fill)
            g += n_tiles
            j += 1
        q_start, q_len, m0, k_start, k_len, col, n_tiles = nq_start, nq_len, nm0, nk_start, nk_len, ncol, nn_tiles
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["n_items"])
def _gdpa_fwd_ws(
    q_desc, k_desc, v_desc, o_desc, O, RECORDS, n_items, num_heads, stride_on, scale,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CHUNK: gl.constexpr, ACT: gl.constexpr,
    Q_STAGES: gl.constexpr, KV_STAGES: gl.constexpr, FOLD: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    LOADER_REGS: gl.constexpr, num_warps: gl.constexpr, PROBE: gl.constexpr = 0,
):
    # descriptors and RECORDS as _gdpa_fwd_resident's; num_warps = 4 (the default partition is the
    # first consumer). PROBE: the resident kernel's timing probes (benchmarks only, wrong outputs):
    # 1 = the loads, waits and stores alone; 2 = the math alone (every query tile of an item read
    # from, and written to, its first tile's rows, which stay in L2)
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [Q_STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [KV_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [KV_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    o_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], o_desc.layout)
    q_ready, q_empty, kv_ready, kv_empty = _ws_barriers(Q_STAGES, KV_STAGES)
    # (the argument tuples written out in the call: a tuple bound to a name first turns its
    # constexprs into tensors; the first consumer is the default partition, the second a worker,
    # which takes no tensors: each is handed its own staging tile)
    gl.warp_specialize([
        (_ws_consumer, (0, q_smem, k_smem, v_smem, o_smem.index(0), q_ready, q_empty, kv_ready, kv_empty, o_desc, O,
                        RECORDS, n_items, num_heads, stride_on, scale, HEAD_DIM, BLOCK_M, BLOCK_N,
                        CHUNK, ACT, FOLD, Q_STAGES, KV_STAGES, PROBE)),
        (_ws_consumer, (1, q_smem, k_smem, v_smem, o_smem.index(1), q_ready, q_empty, kv_ready, kv_empty, o_desc, O,
                        RECORDS, n_items, num_heads, stride_on, scale, HEAD_DIM, BLOCK_M, BLOCK_N,
                        CHUNK, ACT, FOLD, Q_STAGES, KV_STAGES, PROBE)),
        (_ws_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty, RECORDS,
                      n_items, num_heads, CHUNK, BLOCK_M, HEAD_DIM, Q_STAGES, KV_STAGES, PROBE)),
    ],
                       [4, 1], [CONSUMER_REGS, LOADER_REGS])


# The warp-specialized streaming form, for key sides of any length (self-attention, self-1000):
# the same three partitions, but an item is a pair of query tiles (consumer c takes rows
# [64 c, 64 c + 64) of the item's 128) and its keys stream through a ring of KV_STAGES (K, V)
# tile pairs of BLOCK_N keys that both consumers read (kv_empty counts two), O accumulating in
# registers over the keys. Each consumer's query tile is double-buffered by item parity, so the
# loader starts the next item's tiles while this item's keys stream. A consumer without rows in
# the item (its sequence ends in the first tile of the pair) still waits for and releases every
# (K, V) slot and its query buffer (whose phase the loader completes by a plain arrival, with no
# load), so the two agree on every slot and phase without talking.

@gluon.jit
def _ws_stream_loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty, RECORDS,
                      n_items, num_heads, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      HEAD_DIM: gl.constexpr, KV_STAGES: gl.constexpr):
    pid = gl.program_id(0)
    n_programs = gl.num_programs(0)
    j = 0  # items with tiles
    n = 0  # (K, V) tiles loaded
    for r in range(0, gl.cdiv(n_items, n_programs)):
        q_start, q_len, m0, k_start, k_len, col, n_tiles = _item(r, pid, n_programs, n_items, RECORDS, num_heads,
                                                                 1, 2 * BLOCK_M, HEAD_DIM)
        if n_tiles > 0:
            for c in gl.static_range(2):  # both consumers' tiles
                qb = 2 * c + j % 2
                mbarrier.wait(q_empty.index(qb), ((j // 2) & 1) ^ 1)
                # a second tile past the sequence's end is not loaded (its box can lie wholly past
                # the tensor's last row): a plain arrival completes its phase instead
                row0 = m0 + c * BLOCK_M
                _load_q(q_desc, q_smem, q_ready, qb, q_start + row0, col, row0 < q_len)
                mbarrier.arrive(q_ready.index(qb), count=1, pred=row0 >= q_len)
            for t in range(0, gl.cdiv(k_len, BLOCK_N)):
                slot = n % KV_STAGES
                mbarrier.wait(kv_empty.index(slot), ((n // KV_STAGES) & 1) ^ 1)
                bar = kv_ready.index(slot)
                mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
                _tma_load(k_desc, [k_start + t * BLOCK_N, col], bar, k_smem.index(slot))
                _tma_load(v_desc, [k_start + t * BLOCK_N, col], bar, v_smem.index(slot))
                n += 1
            j += 1


@gluon.jit
def _ws_stream_consumer(me: gl.constexpr, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, kv_ready, kv_empty, o_desc, O,
                        RECORDS, n_items, num_heads, stride_on, scale, HEAD_DIM: gl.constexpr,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, ACT: gl.constexpr, FOLD: gl.constexpr,
                        KV_STAGES: gl.constexpr):
    """Consumer ``me``: rows [m0 + 64 me, m0 + 64 me + 64) of every item, over all its keys."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _acc_layout(4, BLOCK_N)
    o_layout: gl.constexpr = _acc_layout(4, HEAD_DIM)
    p_layout: gl.constexpr = _p_layout(o_layout)
    s_zero, o_zero, ac, pid, n_programs = _consumer_start(scale, s_layout, o_layout, BLOCK_M, BLOCK_N, HEAD_DIM, FOLD)
    j = 0
    n = 0
    q_start, q_len, m0, k_start, k_len, col, n_tiles = _item(0, pid, n_programs, n_items, RECORDS,
                                                             num_heads, 1, 2 * BLOCK_M, HEAD_DIM)
    for r in range(0, gl.cdiv(n_items, n_programs)):
        nq_start, nq_len, nm0, nk_start, nk_len, ncol, nn_tiles = _item(
            r + 1, pid, n_programs, n_items, RECORDS, num_heads, 1, 2 * BLOCK_M, HEAD_DIM)
        if n_tiles > 0:
            qb = 2 * me + j % 2
            row0 = m0 + me * BLOCK_M
            n_k = gl.cdiv(k_len, BLOCK_N)
            mbarrier.wait(q_ready.index(qb), (j // 2) & 1)
            if row0 < q_len:
                q_tile = q_smem.index(qb)
                o = o_zero
                for t in range(0, n_k):
                    slot = (n + t) % KV_STAGES
                    mbarrier.wait(kv_ready.index(slot), ((n + t) // KV_STAGES) & 1)
                    s = warpgroup_mma(q_tile, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                    s = warpgroup_mma_wait(0, deps=(s, ))
                    p = _scores(s, k_len - t * BLOCK_N, ac, s_layout, BLOCK_N, ACT, FOLD, dtype, p_layout)
                    o = warpgroup_mma(p, v_smem.index(slot), o, is_async=True)
                    o = warpgroup_mma_wait(0, deps=(o, ))
                    mbarrier.arrive(kv_empty.index(slot), count=1)  # both MMAs have read the slot
                mbarrier.arrive(q_empty.index(qb), count=1)
                _store_o(_fwd_out(o, ac, ACT), o_desc, o_smem, O, q_start, row0, q_len, col, stride_on, o_layout,
                         BLOCK_M, HEAD_DIM)
            else:  # no rows of mine: release what the other consumer uses, in the same order
                for t in range(0, n_k):
                    slot = (n + t) % KV_STAGES
                    mbarrier.wait(kv_ready.index(slot), ((n + t) // KV_STAGES) & 1)
                    mbarrier.arrive(kv_empty.index(slot), count=1)
                mbarrier.arrive(q_empty.index(qb), count=1)
            n += n_k
            j += 1
        q_start, q_len, m0, k_start, k_len, col, n_tiles = nq_start, nq_len, nm0, nk_start, nk_len, ncol, nn_tiles
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["n_items"])
def _gdpa_fwd_ws_stream(
    q_desc, k_desc, v_desc, o_desc, O, RECORDS, n_items, num_heads, stride_on, scale,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, ACT: gl.constexpr,
    KV_STAGES: gl.constexpr, FOLD: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    # RECORDS: query_records over 2 * BLOCK_M rows (one item: a pair of query tiles); q_desc / o_desc in
    # (BLOCK_M, D) boxes, k_desc / v_desc in (BLOCK_N, D) boxes
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [4, BLOCK_M, HEAD_DIM], q_desc.layout)  # consumer x item parity
    k_smem = gl.allocate_shared_memory(dtype, [KV_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [KV_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    o_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], o_desc.layout)
    q_ready, q_empty, kv_ready, kv_empty = _ws_barriers(4, KV_STAGES)
    gl.warp_specialize([
        (_ws_stream_consumer, (0, q_smem, k_smem, v_smem, o_smem.index(0), q_ready, q_empty, kv_ready, kv_empty,
                               o_desc, O, RECORDS, n_items, num_heads, stride_on, scale, HEAD_DIM,
                               BLOCK_M, BLOCK_N, ACT, FOLD, KV_STAGES)),
        (_ws_stream_consumer, (1, q_smem, k_smem, v_smem, o_smem.index(1), q_ready, q_empty, kv_ready, kv_empty,
                               o_desc, O, RECORDS, n_items, num_heads, stride_on, scale, HEAD_DIM,
                               BLOCK_M, BLOCK_N, ACT, FOLD, KV_STAGES)),
        (_ws_stream_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty,
                             RECORDS, n_items, num_heads, BLOCK_M, BLOCK_N, HEAD_DIM, KV_STAGES)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


# ----------------------------------------------------------------------------------------------
# Host side.

# Registers of the warp-specialized kernel: 12 warps (the loader's warpgroup padded to 4) at
# WS_MAXNREG fill the SM's 64K; the partitions then set their own (setmaxnreg, per warpgroup):
# each consumer 232, the loader 40, 2 x 232 + 40 = 3 x 168.
WS_MAXNREG = 168
WS_REGS = (232, 40)  # (second consumer, loader); the default partition (first consumer) gets the rest
PROBES = False  # scripts/bench_gdpa.py --probes: configs with a PROBE field may run (wrong outputs)


@functools.lru_cache(maxsize=None)
def shared_layout(block_rows: int, dim: int, dtype) -> gl.NVMMASharedLayout:
    """The swizzled shared-memory layout of a (block_rows, dim) tile that TMA and wgmma share
    (cached: ~5 us of host time to build, four per launch)."""
    return gl.NVMMASharedLayout.get_default_for([block_rows, dim], ELEMENT_TYPES[dtype])


def descriptors(block_m: int, block_n: int, q, k, v, out):
    """TMA descriptors of q / out in (block_m, D) boxes and k / v in (block_n, D) boxes over the
    [N, H * D] views, or None where the layout does not allow them (common.rows_viewable, or a
    dtype without a Gluon twin)."""
    pairs = ((q, block_m), (k, block_n), (v, block_n), (out, block_m))
    if q.dtype not in _GL_DTYPES or not all(rows_viewable(t, rows) for t, rows in pairs):
        return None
    return [TensorDescriptor(t, [t.shape[0], t.shape[1] * t.shape[2]], [t.stride(0), 1], [rows, t.shape[2]],
                             shared_layout(rows, t.shape[2], t.dtype)) for t, rows in pairs]


def forward(q, k, v, out, records, act: int, scale: float, cfg: tuple, *, fold: bool) -> None:
    """Launch the Gluon forward: ``cfg`` = (block_m, block_n, warps, query-ring stages, programs per
    SM, chunk, 0, 0, kernel at index 8 (1: resident, 2: warp-specialized resident, 3: warp-specialized
    streaming), then for the resident kernel the look-ahead at index 9, for the warp-specialized
    resident one the K/V buffers at index 9, for both a timing probe at index 10; the streaming one's
    (K, V) ring stages are index 3) as gdpa's configs carry it; ``records`` is common.query_records with
    gdpa.item_rows(cfg) rows per item; ``fold`` the caller's gdpa.fold_scale decision, made once per
    call for every kernel it launches. Raises ValueError where the inputs do not allow the kernel (no
    TMA layout, a head_dim, dtype or config it was not built for, buffers beyond an SM's shared
    memory: _not_built): the autotuner then takes the next candidate."""
    block_m, block_n, warps, stages, per_sm, chunk = cfg[:6]
    heads, dim = q.shape[1], q.shape[2]
    kind, kv_stages, probe = config_field(cfg, 8), config_field(cfg, 9), config_field(cfg, 10)
    why = _not_built(cfg, dim, q.element_size())
    if why:
        raise ValueError(f"gdpa (Hopper): {why}")
    descs = descriptors(block_m, block_n, q, k, v, out)
    if descs is None:
        raise ValueError("gdpa (Hopper): q/k/v/out do not allow TMA descriptors (heads adjacent, 16-byte aligned rows)")
    n_items = records.shape[0] * heads
    if n_items == 0:
        return
    grid = (num_programs(n_items, per_sm, q.device),)
    args = (*descs, out, records, n_items, heads, out.stride(0), scale)
    tiles = dict(HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, ACT=act, FOLD=fold)
    ws = dict(CONSUMER_REGS=WS_REGS[0], LOADER_REGS=WS_REGS[1], num_warps=4, maxnreg=WS_MAXNREG)
    if kind == 3:
        _gdpa_fwd_ws_stream[grid](*args, **tiles, KV_STAGES=stages, **ws)
    elif kind == 2:
        _gdpa_fwd_ws[grid](*args, **tiles, CHUNK=chunk, Q_STAGES=stages, KV_STAGES=kv_stages, **ws, PROBE=probe)
    else:
        _gdpa_fwd_resident[grid](*args, **tiles, CHUNK=chunk, Q_STAGES=stages, LOOKAHEAD=kv_stages, num_warps=warps,
                                 PROBE=probe)


def _not_built(cfg: tuple, dim: int, size: int) -> str | None:
    """Why no kernel of this module runs ``cfg`` at ``dim`` (``size``-byte elements), or None."""
    block_m, block_n, warps, stages, per_sm, chunk = cfg[:6]
    kind, kv_stages, probe = config_field(cfg, 8), config_field(cfg, 9), config_field(cfg, 10)
    if probe and (kind not in (1, 2) or not PROBES):
        return (f"config {cfg} is a timing probe (wrong outputs by design); only scripts/bench_gdpa.py --probes "
                "runs it, on the resident kernels")
    if dim not in (64, 128) or warps != 4 or block_m != 64 or kind not in (1, 2, 3):
        return f"head_dim {dim} with config {cfg} is not built"
    if kind == 3:  # the streaming kernel: 4 query tiles (2 consumers x 2 items), `stages` (K, V) slots
        need = ws_shared_bytes(block_m, block_n, dim, 4, stages, size)
        if (block_n not in (32, 64, 128) or chunk != 0 or per_sm != 1 or stages < 1 or any(cfg[6:8])
                or len(cfg) > 9 or need > _SMEM_PER_BLOCK):
            return (f"streaming warp-specialized config {cfg} at head_dim {dim} is not built (32, 64 or 128 keys a "
                    f"tile, no chunk, one program per SM, at most {_SMEM_PER_BLOCK} B of shared memory; it needs "
                    f"{need} B)")
        return None
    # the resident kernel runs one warpgroup: a slot is refilled (and K/V reloaded) right after this
    # warpgroup's MMA read it, which with a second warpgroup could still be waiting on that slot's
    # previous phase (the warp-specialized kernel's second warpgroup is a partition of its own)
    if chunk < 1:
        return f"head_dim {dim} with config {cfg} is not built"
    if config_field(cfg, 11):
        return (f"config {cfg}: the consumers' ping-pong (twelfth field) was measured and removed (slower on the H200, "
                "docs/benchmarks.md)")
    if kind == 2:
        need = ws_shared_bytes(block_m, block_n, dim, stages, kv_stages, size)
        if per_sm != 1 or kv_stages not in (1, 2) or stages < 2 or stages % 2 or need > _SMEM_PER_BLOCK:
            return (f"warp-specialized config {cfg} at head_dim {dim} is not built (one program per SM, an even "
                    f"number of query slots, 1 or 2 K/V buffers, at most {_SMEM_PER_BLOCK} B of shared memory; it "
                    f"needs {need} B)")
    return None


SMEM_PER_SM, SMEM_RESERVED = 233472, 1024  # sm_90: shared memory of an SM, reserved per program
_SMEM_PER_BLOCK = SMEM_PER_SM - SMEM_RESERVED  # the most one program can have (227 KiB)


def ws_shared_bytes(block_m: int, block_n: int, dim: int, q_stages: int, kv_stages: int, size: int) -> int:
    """Shared memory of a warp-specialized kernel: ``q_stages`` query tiles (the resident form's
    ring, the streaming form's four), ``kv_stages`` (K, V) buffers of ``block_n`` keys, two output
    staging tiles, and the mbarriers (sm_90 ptxas, Triton 3.6: 229,704 B at 4 query slots, 2 K/V
    buffers, 128 keys, D = 128, bf16; the tiles alone are 229,376)."""
    return (q_stages * block_m + 2 * kv_stages * block_n + 2 * block_m) * dim * size + 512


def _torch_dtypes():
    import torch

    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def _element_types():
    import torch

    return {**_torch_dtypes(), torch.float32: gl.float32}


_GL_DTYPES = _torch_dtypes()  # the dtypes the kernels compute in
ELEMENT_TYPES = _element_types()  # the dtypes a shared tile can hold (fp32: block attention's rope tables)
