"""Block attention in Triton, RoPE fused: softmax attention inside consecutive blocks of each sequence.

Math, per sequence (length L) and block c (rows r in [c*BS, min((c+1)*BS, L)), BS = block_size):
    q~_r, k~_r = rope(q_r, r), rope(k_r, r)        rotation by the position r from the sequence start
    o_r = sum_{j in block c} softmax_j(scale * q~_r . k~_j) v_j      (non-causal, no bias)
rope (rotate-half convention, as gemctl.ops.apply_rope): with x = [x1, x2] split at D/2 and the
tables' rows c = cos[r], s = sin[r], rope(x, r) = [x1 c - x2 s, x2 c + x1 s]. The tables are
``rope=(cos, sin)``, each ``[>= max_len, D // 2]`` (any float dtype, read and applied in fp32), or a
float base frequency b, for which the tables cos/sin(r * b ** (-i / (D/2))) are built in float64,
stored as fp32 on the device and cached per (base, D, device), grown to the next power of two of
max_len.

Supported: q, k, v [N, H, D] (any row/head strides, contiguous head dim), int64 offsets [B+1],
block sizes 16-128 (GEM uses 64; 32/64/128 are tested), D in {32, 64, 128}, fp16/bf16 on CUDA,
fp32 everywhere (the CPU tier runs under TRITON_INTERPRET=1; fp32 dots use TF32 on the GPU).

Kernels: one program per (sequence, block) work item and group of heads (one head, or all heads
looped inside the program with the rotation tables loaded once). The work list holds only valid
blocks (a sequence of length L gets ceil(L / BS), an empty one none), built on the host from the
offsets' host copy (gemctl.ops.host: no device sync) and cached per batch layout
(common.query_work with a tile of BS rows). The whole block fits one tile, so there is no online
softmax: the forward loads q, k, v once, rotates the q and k tiles in registers (two halves, cos/sin
rows by position; the rotated copies never reach HBM), and writes o and the per-row log2-sum-exp2
(fp32, for the backward). The backward is one kernel too, per (block, head): it recomputes
p = exp2(s - lse), computes delta = rowsum(do * o) in-kernel (no pre-pass), dv = p^T do,
ds = p * (do v^T - delta), dq~ = ds k~, dk~ = ds^T q~, and applies the inverse rotation
(by -theta: [d1 c + d2 s, d2 c - d1 s]) to dq~ and dk~ in the epilogue. No atomics, no zero fills
(each row belongs to exactly one block): bitwise reproducible.

Partial last blocks: rows at or beyond L load as 0 and are never stored; keys at or beyond L get a
-inf score (forward) or p = 0 (backward). A block always holds >= 1 valid key, so every stored row
has a finite log-sum-exp.

Bytes that must move (E = element size, T = tokens, H heads, D head dim):
    forward  = 3*T*H*D*E (q, k, v) + T*H*D*E (o) + 4*T*H (lse)
    backward = 5*T*H*D*E (q, k, v, o, do) + 4*T*H (lse) + 3*T*H*D*E (dq, dk, dv)
plus the rope tables' rows, read through L2 (max_len * D * 4 bytes of unique data).
Each K/V element serves one block of queries, so the kernels are memory-bound at every block size.

Shared memory per program (sm_90 compile, bf16, D = 128, 4 warps; scripts/check_kernels_build.py):
forward 32 / 48 KB at block 64 without / with rope, backward 73 / 105 KB; block 128 with rope:
forward 96 KB, backward 225 KB (one program per SM). Not yet measured on a GPU.
Known limits: no TMA, no warp specialization, no persistent grid (Triton 3.x); the tables get no
gradient.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from gemctl.ops import host
from gemctl.ops.triton import common
from gemctl.ops.triton.common import bucket_len, load_rows, pick_config, store_rows

LOG2E = 1.4426950408889634

# Configs: (num_warps, num_stages, items per program, programs per SM, prefetch).
# An item is one (block, head) pair; items are numbered block-major (the heads of a block are
# consecutive), and each program takes a contiguous run of them:
#   items per program k >= 1: k items (k = H: one block, all its heads); 0: H (all heads of a block);
#   programs per SM g > 0: a persistent grid of g programs per SM, each taking cdiv(items, grid) items
#   (the items-per-program field is then ignored);
#   prefetch 1: while an item computes, its successor's tiles are already being loaded (register
#   double buffering; the successor's metadata is fetched one more item ahead), so a program
#   keeps memory busy through its compute phases; 0: load, compute, store, one item after another.
_FWD_CANDIDATES = [(4, 1, 1, 0, 0), (8, 1, 1, 0, 0), (4, 1, 0, 0, 1), (8, 1, 0, 0, 1), (8, 1, 0, 2, 1),
                   (4, 1, 0, 4, 1), (8, 1, 0, 1, 1), (4, 2, 0, 0, 0)]
_BWD_CANDIDATES = [(4, 1, 1, 0, 0), (8, 1, 1, 0, 0), (8, 1, 0, 0, 1), (8, 1, 0, 1, 1), (8, 1, 0, 2, 1),
                   (4, 1, 0, 2, 1), (8, 2, 0, 0, 0)]
_INTERPRET_CONFIG = (1, 1, 0, 0, 1)  # all heads of a block per program, prefetching: the CPU tier runs the loop
SUPPORTED_DIMS = (32, 64, 128)


# ----------------------------------------------------------------------------------------------
@triton.jit
def _meta(WORK, i, i_end, num_heads):
    """Item i -> (value row of its sequence's start, the sequence's length, the block's first row in
    the sequence, head). WORK: int32 [n_blocks, 4] = (start, length, first row, 0); i >= i_end gives
    length 0, so every load and store of the item is masked off (no memory traffic)."""
    ok = i < i_end
    w = tl.where(ok, i // num_heads, 0)
    start = tl.load(WORK + 4 * w)
    length = tl.where(ok, tl.load(WORK + 4 * w + 1), 0)
    first = tl.load(WORK + 4 * w + 2)
    return start, length, first, i % num_heads


@triton.jit
def _rope_rows(COS, SIN, first, length, stride_rope, BLOCK: tl.constexpr, HALF: tl.constexpr, ROPE: tl.constexpr):
    """cos and sin rows (BS, D/2) of the block's positions (fp32); rows >= length read 0.
    Without ROPE, (1, 1) zeros that nothing reads."""
    if ROPE:
        rows = first + tl.arange(0, BLOCK)
        mask = (rows < length)[:, None]
        ptrs = rows[:, None] * stride_rope + tl.arange(0, HALF)[None, :]
        c = tl.load(COS + ptrs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(SIN + ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        c = tl.zeros((1, 1), dtype=tl.float32)
        s = tl.zeros((1, 1), dtype=tl.float32)
    return c, s


@triton.jit
def _rotate(x1, x2, c, s, ROPE: tl.constexpr):
    """[x1, x2] -> [x1 c - x2 s, x2 c + x1 s] (rotation of each pair by +theta), computed in fp32 and
    returned in x's dtype (the dot operands); unchanged without ROPE."""
    if ROPE:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        x1, x2 = (f1 * c - f2 * s).to(x1.dtype), (f2 * c + f1 * s).to(x2.dtype)
    return x1, x2


@triton.jit
def _load_halves(PTR, start, rows, length, stride_n, head_offset, HALF: tl.constexpr):
    """The two halves (BS, D/2) of one head's q or k tile, as stored."""
    offs_half = tl.arange(0, HALF)
    x1 = load_rows(PTR, start, rows, length, stride_n, head_offset, offs_half)
    x2 = load_rows(PTR, start, rows, length, stride_n, head_offset + HALF, offs_half)
    return x1, x2


@triton.jit
def _load_fwd(Q, K, V, start, length, first, h, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
              HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """An item's forward operands: q and k halves, v (all issued together: one memory round trip)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    rows = first + tl.arange(0, BLOCK)
    q1, q2 = _load_halves(Q, start, rows, length, stride_qn, h * stride_qh, HALF)
    k1, k2 = _load_halves(K, start, rows, length, stride_kn, h * stride_kh, HALF)
    v = load_rows(V, start, rows, length, stride_vn, h * stride_vh, tl.arange(0, HEAD_DIM))
    return q1, q2, k1, k2, v


@triton.jit
def _fwd_item(O, LSE, q1, q2, k1, k2, v, c, s, start, length, first, h, num_heads, stride_on, stride_oh, qk_scale,
              HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ROPE: tl.constexpr):
    rows = first + tl.arange(0, BLOCK)
    q1, q2 = _rotate(q1, q2, c, s, ROPE)
    k1, k2 = _rotate(k1, k2, c, s, ROPE)
    scores = (tl.dot(q1, tl.trans(k1)) + tl.dot(q2, tl.trans(k2))) * qk_scale  # log2 units
    scores = tl.where((rows < length)[None, :], scores, float("-inf"))
    m = tl.max(scores, 1)  # finite for stored rows: key row `first` is always valid
    p = tl.math.exp2(scores - m[:, None])
    l = tl.sum(p, 1)
    out = tl.dot(p.to(v.dtype), v) / l[:, None]
    store_rows(O, out, start, rows, length, stride_on, h * stride_oh, tl.arange(0, HEAD_DIM))
    tl.store(LSE + (start + rows) * num_heads + h, m + tl.math.log2(l), mask=rows < length)


@triton.jit
def _block_attn_fwd(
    Q, K, V, O, LSE, COS, SIN, WORK, num_heads, n_items, items_per_program,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh, stride_rope, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ROPE: tl.constexpr, PREFETCH: tl.constexpr,
):
    # Q/K/V/O: [N, H, D] jagged values; LSE: fp32 [N, H] log2-sum-exp2 per row (for the backward);
    # COS/SIN: [>= max_len, D/2] rotation tables (unused unless ROPE); WORK: int32 [n_blocks, 4]
    # (see _meta). Program pid takes items [pid * items_per_program, ...) (item = block * H + head).
    HALF: tl.constexpr = HEAD_DIM // 2
    i0 = tl.program_id(0) * items_per_program
    i_end = tl.minimum(i0 + items_per_program, n_items)
    if PREFETCH:
        st, ln, fr, hd = _meta(WORK, i0, i_end, num_heads)
        q1, q2, k1, k2, v = _load_fwd(Q, K, V, st, ln, fr, hd, stride_qn, stride_qh, stride_kn, stride_kh,
                                      stride_vn, stride_vh, HEAD_DIM, BLOCK)
        n_st, n_ln, n_fr, n_hd = _meta(WORK, i0 + 1, i_end, num_heads)
    for i in range(i0, i_end):
        if PREFETCH:  # this item's tiles were loaded last iteration; issue the next item's now
            c_st, c_ln, c_fr, c_hd = st, ln, fr, hd
            cq1, cq2, ck1, ck2, cv = q1, q2, k1, k2, v
            st, ln, fr, hd = n_st, n_ln, n_fr, n_hd
            n_st, n_ln, n_fr, n_hd = _meta(WORK, i + 2, i_end, num_heads)
            q1, q2, k1, k2, v = _load_fwd(Q, K, V, st, ln, fr, hd, stride_qn, stride_qh, stride_kn, stride_kh,
                                          stride_vn, stride_vh, HEAD_DIM, BLOCK)
        else:
            c_st, c_ln, c_fr, c_hd = _meta(WORK, i, i_end, num_heads)
            cq1, cq2, ck1, ck2, cv = _load_fwd(Q, K, V, c_st, c_ln, c_fr, c_hd, stride_qn, stride_qh, stride_kn,
                                               stride_kh, stride_vn, stride_vh, HEAD_DIM, BLOCK)
        c, s = _rope_rows(COS, SIN, c_fr, c_ln, stride_rope, BLOCK, HALF, ROPE)
        _fwd_item(O, LSE, cq1, cq2, ck1, ck2, cv, c, s, c_st, c_ln, c_fr, c_hd, num_heads, stride_on, stride_oh,
                  qk_scale, HEAD_DIM, BLOCK, ROPE)


@triton.jit
def _load_bwd(Q, K, V, O, DO, LSE, start, length, first, h, num_heads, stride_qn, stride_qh, stride_kn, stride_kh,
              stride_vn, stride_vh, stride_on, stride_oh, stride_don, stride_doh, HEAD_DIM: tl.constexpr,
              BLOCK: tl.constexpr):
    """An item's backward operands, all issued together (one memory round trip)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    rows = first + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    q1, q2 = _load_halves(Q, start, rows, length, stride_qn, h * stride_qh, HALF)
    k1, k2 = _load_halves(K, start, rows, length, stride_kn, h * stride_kh, HALF)
    v = load_rows(V, start, rows, length, stride_vn, h * stride_vh, offs_d)
    o = load_rows(O, start, rows, length, stride_on, h * stride_oh, offs_d)
    do = load_rows(DO, start, rows, length, stride_don, h * stride_doh, offs_d)
    lse = tl.load(LSE + (start + rows) * num_heads + h, mask=rows < length, other=float("inf"))  # inf: p = 0
    return q1, q2, k1, k2, v, o, do, lse


@triton.jit
def _bwd_item(DQ, DK, DV, COS, SIN, q1, q2, k1, k2, v, o, do, lse, start, length, first, h, stride_rope,
              stride_dqn, stride_dqh, stride_dkn, stride_dkh, stride_dvn, stride_dvh, qk_scale, scale,
              HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ROPE: tl.constexpr):
    # Ordered to shorten live ranges (registers, not memory, limit the programs per SM): o dies
    # after delta, v and do after dv/dp, p after ds; the cos/sin rows are read again (L1/L2) for
    # the epilogue instead of staying live across the dots.
    HALF: tl.constexpr = HEAD_DIM // 2
    rows = first + tl.arange(0, BLOCK)
    offs_half = tl.arange(0, HALF)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)  # (BS,), in-kernel: no pre-pass
    c, s = _rope_rows(COS, SIN, first, length, stride_rope, BLOCK, HALF, ROPE)
    q1, q2 = _rotate(q1, q2, c, s, ROPE)
    k1, k2 = _rotate(k1, k2, c, s, ROPE)
    scores = (tl.dot(q1, tl.trans(k1)) + tl.dot(q2, tl.trans(k2))) * qk_scale
    p = tl.where((rows < length)[None, :], tl.math.exp2(scores - lse[:, None]), 0.0)  # keys beyond L: 0
    dv = tl.dot(tl.trans(p.to(do.dtype)), do)
    store_rows(DV, dv, start, rows, length, stride_dvn, h * stride_dvh, tl.arange(0, HEAD_DIM))
    dp = tl.dot(do, tl.trans(v))
    ds = (p * (dp - delta[:, None])).to(q1.dtype)  # gradient of the natural-units score
    c, s = _rope_rows(COS, SIN, first, length, stride_rope, BLOCK, HALF, ROPE)
    dq1, dq2 = tl.dot(ds, k1) * scale, tl.dot(ds, k2) * scale
    if ROPE:  # the rotation's backward: rotate the gradients by -theta
        dq1, dq2 = dq1 * c + dq2 * s, dq2 * c - dq1 * s
    store_rows(DQ, dq1, start, rows, length, stride_dqn, h * stride_dqh, offs_half)
    store_rows(DQ, dq2, start, rows, length, stride_dqn, h * stride_dqh + HALF, offs_half)
    ds_t = tl.trans(ds)
    dk1, dk2 = tl.dot(ds_t, q1) * scale, tl.dot(ds_t, q2) * scale
    if ROPE:
        dk1, dk2 = dk1 * c + dk2 * s, dk2 * c - dk1 * s
    store_rows(DK, dk1, start, rows, length, stride_dkn, h * stride_dkh, offs_half)
    store_rows(DK, dk2, start, rows, length, stride_dkn, h * stride_dkh + HALF, offs_half)


@triton.jit
def _block_attn_bwd(
    Q, K, V, O, DO, LSE, DQ, DK, DV, COS, SIN, WORK, num_heads, n_items, items_per_program,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh,
    stride_don, stride_doh, stride_dqn, stride_dqh, stride_dkn, stride_dkh, stride_dvn, stride_dvh,
    stride_rope, qk_scale, scale,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ROPE: tl.constexpr, PREFETCH: tl.constexpr,
):
    # Same items as the forward. Each item reads q, k, v, o, do and lse once and writes dq, dk, dv
    # once: p = exp2(s - lse) is recomputed, delta = rowsum(do * o) computed here.
    HALF: tl.constexpr = HEAD_DIM // 2
    i0 = tl.program_id(0) * items_per_program
    i_end = tl.minimum(i0 + items_per_program, n_items)
    if PREFETCH:
        st, ln, fr, hd = _meta(WORK, i0, i_end, num_heads)
        q1, q2, k1, k2, v, o, do, lse = _load_bwd(Q, K, V, O, DO, LSE, st, ln, fr, hd, num_heads, stride_qn, stride_qh,
                                                  stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh,
                                                  stride_don, stride_doh, HEAD_DIM, BLOCK)
        n_st, n_ln, n_fr, n_hd = _meta(WORK, i0 + 1, i_end, num_heads)
    for i in range(i0, i_end):
        if PREFETCH:
            c_st, c_ln, c_fr, c_hd = st, ln, fr, hd
            cq1, cq2, ck1, ck2, cv, co, cdo, clse = q1, q2, k1, k2, v, o, do, lse
            st, ln, fr, hd = n_st, n_ln, n_fr, n_hd
            n_st, n_ln, n_fr, n_hd = _meta(WORK, i + 2, i_end, num_heads)
            q1, q2, k1, k2, v, o, do, lse = _load_bwd(Q, K, V, O, DO, LSE, st, ln, fr, hd, num_heads, stride_qn,
                                                      stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on,
                                                      stride_oh, stride_don, stride_doh, HEAD_DIM, BLOCK)
        else:
            c_st, c_ln, c_fr, c_hd = _meta(WORK, i, i_end, num_heads)
            cq1, cq2, ck1, ck2, cv, co, cdo, clse = _load_bwd(Q, K, V, O, DO, LSE, c_st, c_ln, c_fr, c_hd, num_heads,
                                                              stride_qn, stride_qh, stride_kn, stride_kh, stride_vn,
                                                              stride_vh, stride_on, stride_oh, stride_don, stride_doh,
                                                              HEAD_DIM, BLOCK)
        _bwd_item(DQ, DK, DV, COS, SIN, cq1, cq2, ck1, ck2, cv, co, cdo, clse, c_st, c_ln, c_fr, c_hd, stride_rope,
                  stride_dqn, stride_dqh, stride_dkn, stride_dkh, stride_dvn, stride_dvh, qk_scale, scale,
                  HEAD_DIM, BLOCK, ROPE)


# ----------------------------------------------------------------------------------------------
# Host side: rope tables, launchers, autograd.

_rope_cache: dict = {}


def rope_tables(base: float, length: int, dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin tables ``[>= length, dim // 2]`` of positions r and frequencies
    base ** (-i / (dim / 2)), computed in float64; cached on the device per (base, dim), grown to
    the next power of two of ``length`` so a new batch does not rebuild them."""
    key = (float(base), dim, torch.device(device))
    tables = _rope_cache.get(key)
    if tables is None or tables[0].shape[0] < length:
        half = dim // 2
        pos = torch.arange(bucket_len(max(length, 1)), dtype=torch.float64)[:, None]
        angle = pos * float(base) ** (-torch.arange(half, dtype=torch.float64) / half)
        tables = (torch.cos(angle).to(device, torch.float32), torch.sin(angle).to(device, torch.float32))
        _rope_cache[key] = tables
    return tables


def _rope_args(cos, sin, rope_base, max_len, q):
    """(cos, sin, ROPE) for the kernels: the given tables, tables built from a base frequency, or
    (without rope) q as a placeholder pointer that the kernels never read."""
    if cos is None and rope_base:
        cos, sin = rope_tables(rope_base, max_len, q.shape[-1], q.device)
    if cos is None:
        return q, q, False
    return cos, sin, True


def _block_meta(offsets, block_size: int, device) -> torch.Tensor:
    """int32 [n_blocks, 4] = (value row of the sequence start, sequence length, first row of the block
    in the sequence, 0) for every valid block (a sequence of length L has ceil(L / BS), an empty one
    none), built on the host from the offsets' host copy (no device sync) and cached per batch
    layout, so the kernels fetch an item's whole description with one dependent load."""

    def build():
        lengths = common._lengths(offsets)
        work = common.tile_work(lengths, lambda seq, tile: lengths[seq], block_size)
        starts = np.concatenate([[0], np.cumsum(lengths)])[:-1]
        seq, tile = work[:, 0], work[:, 1]
        meta = np.stack([starts[seq], lengths[seq], tile * block_size, np.zeros_like(seq)], 1)
        return common._to_device(np.ascontiguousarray(meta.astype(np.int32)), device)

    return host.cached_plan(offsets, ("block_meta", block_size), build)


def _full_config(cfg) -> tuple:
    """A config tuple padded to (num_warps, num_stages, items per program, programs per SM, prefetch)."""
    return tuple(cfg) + (1, 1, 0, 0, 0)[len(cfg):]


def _launch(kernel, offsets, heads, block_size, cfg, args, dim, rope, device):
    warps, stages, per_program, per_sm, prefetch = _full_config(cfg)
    meta = _block_meta(offsets, block_size, device)
    n_items = meta.shape[0] * heads
    if not n_items:
        return
    if per_sm > 0:  # persistent grid: contiguous runs of items
        per_program = triton.cdiv(n_items, common.num_programs(n_items, per_sm, device))
    elif per_program <= 0:
        per_program = heads
    kernel[(triton.cdiv(n_items, per_program),)](
        *args[:-1], meta, heads, n_items, per_program, *args[-1],
        HEAD_DIM=dim, BLOCK=block_size, ROPE=rope, PREFETCH=bool(prefetch), num_warps=warps, num_stages=stages)


def _forward(q, k, v, cos, sin, offsets, max_len, block_size, rope_base, scale):
    n, heads, dim = q.shape
    out = torch.empty_like(q)  # every row belongs to one block, which writes it
    lse = torch.empty(n, heads, device=q.device, dtype=torch.float32)
    cos, sin, rope = _rope_args(cos, sin, rope_base, max_len, q)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
               cos.stride(0), scale * LOG2E)

    def run(cfg):
        _launch(_block_attn_fwd, offsets, heads, block_size, cfg, (q, k, v, out, lse, cos, sin, strides), dim, rope, q.device)

    key = ("block_attention_fwd", dim, q.dtype, block_size, rope, heads, bucket_len(n))
    run(pick_config(key, _FWD_CANDIDATES, run, _INTERPRET_CONFIG))
    return out, lse


def _backward(do, q, k, v, out, lse, cos, sin, offsets, max_len, block_size, rope_base, scale):
    n, heads, dim = q.shape
    do = do if do.stride(-1) == 1 else do.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    cos, sin, rope = _rope_args(cos, sin, rope_base, max_len, q)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
               do.stride(0), do.stride(1), dq.stride(0), dq.stride(1), dk.stride(0), dk.stride(1), dv.stride(0),
               dv.stride(1), cos.stride(0), scale * LOG2E, scale)

    def run(cfg):
        args = (q, k, v, out, do, lse, dq, dk, dv, cos, sin, strides)
        _launch(_block_attn_bwd, offsets, heads, block_size, cfg, args, dim, rope, q.device)

    key = ("block_attention_bwd", dim, q.dtype, block_size, rope, heads, bucket_len(n))
    run(pick_config(key, _BWD_CANDIDATES, run, _INTERPRET_CONFIG))
    return dq, dk, dv


def _contiguous_dim(*tensors):
    # Any row/head strides work (views of a fused QKV projection need no copy); the head dim and
    # the tables' columns must be contiguous.
    return tuple(t if t is None or t.stride(-1) == 1 else t.contiguous() for t in tensors)


# torch.library custom ops with fakes: torch.compile traces them without a graph break; eager
# calls go through the autograd.Function below (no custom-op wrapper cost on the host).
@torch.library.custom_op("gemctl::block_attention_fwd", mutates_args=())
def _block_attention_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
    offsets: torch.Tensor, max_len: int, block_size: int, rope_base: float, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v, cos, sin = _contiguous_dim(q, k, v, cos, sin)
    return _forward(q, k, v, cos, sin, offsets, max_len, block_size, rope_base, scale)


@_block_attention_fwd_op.register_fake
def _(q, k, v, cos, sin, offsets, max_len, block_size, rope_base, scale):
    return torch.empty_like(q), q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)


@torch.library.custom_op("gemctl::block_attention_bwd", mutates_args=())
def _block_attention_bwd_op(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cos: torch.Tensor | None, sin: torch.Tensor | None, offsets: torch.Tensor, max_len: int, block_size: int,
    rope_base: float, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, cos, sin = _contiguous_dim(q, k, v, cos, sin)
    return _backward(do, q, k, v, out, lse, cos, sin, offsets, max_len, block_size, rope_base, scale)


@_block_attention_bwd_op.register_fake
def _(do, q, k, v, out, lse, cos, sin, offsets, max_len, block_size, rope_base, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cos, sin, offsets, *args = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cos, sin, offsets)
    ctx.args = tuple(args)


def _backward_rule(ctx, do, _dlse):
    q, k, v, out, lse, cos, sin, offsets = ctx.saved_tensors
    dq, dk, dv = _block_attention_bwd_op(do, q, k, v, out, lse, cos, sin, offsets, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None


torch.library.register_autograd("gemctl::block_attention_fwd", _backward_rule, setup_context=_setup_context)


class _BlockAttentionEager(torch.autograd.Function):
    """The custom ops' forward and backward for eager mode, without the custom-op wrapper's host cost."""

    @staticmethod
    def forward(ctx, q, k, v, cos, sin, offsets, max_len, block_size, rope_base, scale):
        q, k, v, cos, sin = _contiguous_dim(q, k, v, cos, sin)
        out, lse = _forward(q, k, v, cos, sin, offsets, max_len, block_size, rope_base, scale)
        ctx.save_for_backward(q, k, v, out, lse, cos, sin, offsets)
        ctx.args = (max_len, block_size, rope_base, scale)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, cos, sin, offsets = ctx.saved_tensors
        dq, dk, dv = _backward(do, q, k, v, out, lse, cos, sin, offsets, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None


def block_attention_triton(q, k, v, offsets, max_len, *, block_size=64, rope=None, scale=None):
    """Triton implementation of :func:`gemctl.ops.block_attention` (same signature, minus backend,
    plus ``scale``, default D**-0.5). ``rope`` is ``(cos, sin)`` tables ``[>= max_len, D // 2]`` or a
    float base frequency (tables built and cached on the device, see :func:`rope_tables`)."""
    dim = q.shape[-1]
    if dim not in SUPPORTED_DIMS:
        raise ValueError(f"block_attention (triton): head_dim must be one of {SUPPORTED_DIMS}; got {dim}")
    if not (16 <= block_size <= 128 and block_size & (block_size - 1) == 0):
        raise ValueError(f"block_attention (triton): block_size must be a power of two in [16, 128]; got {block_size}")
    cos = sin = None
    rope_base = 0.0
    if isinstance(rope, (int, float)) and not isinstance(rope, bool):
        if not (rope > 0 and math.isfinite(rope)):
            raise ValueError(f"block_attention: a rope base frequency must be positive, got {rope}")
        rope_base = float(rope)
    elif rope is not None:
        cos, sin = rope
        if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != dim // 2 or cos.shape[0] < max_len:
            raise ValueError(f"block_attention: rope tables must be [>= max_len ({max_len}), D // 2 ({dim // 2})], "
                             f"got cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
        cos, sin = cos.detach(), sin.detach()
    scale = dim**-0.5 if scale is None else float(scale)
    args = (q, k, v, cos, sin, offsets, int(max_len), int(block_size), rope_base, scale)
    if torch.compiler.is_compiling():  # traced as a custom op: no graph break
        return _block_attention_fwd_op(*args)[0]
    return _BlockAttentionEager.apply(*args)
