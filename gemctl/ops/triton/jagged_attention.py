"""Jagged flash attention in Triton: softmax attention on unpadded sequences, forward and backward.

Math, per sequence b (Lq = Lq_b query rows, Lk = Lk_b key rows, shift = Lk - Lq):
    s_ij = scale * q_i . k_j + bias_h(|i + shift - j|)          (i < Lq, j < Lk)
    causal: key j is visible to query i iff j <= i + shift       (last query sees the last key)
    window w: key j is visible iff i + shift - w < j (and j < i + shift + w when not causal): with
              causal the w most recent keys up to the query's aligned position, else |d| < w
    o_i  = sum_j softmax_j(s_ij) v_j ;  a query with no visible key gets o_i = 0
Supported: q [Nq, H, D], k/v [Nk, H, D] (K/V lengths independent of Q: cross-attention), int64
offsets [B+1]; D in {16, 32, 64, 128, 256}; fp16 and bf16 on CUDA, fp32 everywhere (the CPU tier
runs under TRITON_INTERPRET=1); optional relative-position bias (gemctl.ops.RelativePositionBias)
with its gradient; optional sliding window (an int >= 1), with or without causal and bias.

Scheduling: work is a host-built list of (sequence, tile) pairs (only valid tiles: a sequence of
length L gets ceil(L / BLOCK) programs, an empty one none), sorted longest first so the long
sequences start early and short ones fill the tail. The host list comes from the offsets' host copy
(gemctl.ops.host), built once per batch and shared by every layer, forward and backward.

Masking: tiles fully inside the sequence (and, when causal, fully below the diagonal; with a
window, fully inside the band) run without any mask; only the last key tile of a row block, the
diagonal tiles and the band's edge tiles apply one.

Sliding window: every pass visits only the tiles that intersect the band |d| < w (causal:
0 <= d < w): a query tile loops over about (w + BLOCK_M) / BLOCK_N key tiles, a key tile over
about (w + BLOCK_N) / BLOCK_M query tiles, so forward and backward cost O(L * w), not O(L^2).
The work lists are the same as without a window (their longest-first order is only a
scheduling heuristic; with a window, tiles cost about the same everywhere). A masked score
is -inf, never 0: with a zeroed score, a row whose valid logits all sit far below 0 (a large
negative bias) would lose them to exp(0 - m) terms and cancel catastrophically when the surplus
is subtracted, so this kernel keeps the exact max over valid entries instead.

Backward: delta = rowsum(dO * O) in one pass (_bwd_delta); dK/dV per key tile looping over the
query tiles that see it; dQ (and the bias gradient) in a separate pass per query tile looping over
key tiles. Every gradient row is written by a program (key tiles of sequences without queries
store zeros), so nothing is zero-filled first. No atomics: the bias gradient is accumulated per
program in registers and summed over programs in a fixed order, so gradients are bitwise identical
for identical inputs.

Bias: the kernels read bias_h(|d|) from a per-|distance| table [H, max_distance + 1] (fp32, log2
units), one gather per score. In self-attention (one offsets layout for queries and keys, so
shift = 0) every forward tile's distances are d0 + a - b with d0 = m0 - start_n a multiple of
G = min(BLOCK_M, BLOCK_N): the forward then reads each tile's bias as one plain 2-D tile of a table
[H, NT, BLOCK_M, BLOCK_N] built per call from the per-distance one (bias_tile_table; the same
values, so the same bits), 1.3-1.6x faster than the gathers on the H200, best config against best
(docs/benchmarks.md). The table grows with heads and max_distance (H = 4, max_distance 1024:
2.2-4.7 MB; 16 heads at 2048 ~17-36 MB a call); a launch whose table would pass _BIAS_TILE_BYTES
(64 MiB) gathers instead. The backward passes read the same tiles (_BIAS_TILES_BWD; the dK/dV
pass's transposed formulation from the table stored keys x queries), bit-identical to their
gathers. The dQ pass's bias gradient sums a tile spanning many buckets along its diagonals first
(_dbias_tile). Together 1.7-1.9x on the biased backward and 1.25-1.31x on the small_h200 step
(H200, docs/benchmarks.md).

Measured on one H200 (2026-11-29): see docs/benchmarks.md ("jagged_attention").
TMA: configs that load the tiles needing no mask through tensor descriptors (K/V in the forward
and dQ passes, Q/dO in the dK/dV pass); masked tiles keep masked loads, so no row of another
sequence is ever read into a tile. They join autotuning once their GPU tier passes
(_GPU_CHECKED). Known limits: no warp specialization or persistent scheduling yet (Triton 3.6).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemctl.ops import host
from gemctl.ops.bias import RelativePositionBias, relative_position_bucket
from gemctl.ops.triton.common import (
    bucket_len, cdiv, config_field, gpu_checked, key_work, load_rows, load_tile, next_pow2, pick_config, query_work,
    row_descriptors, same_offsets, store_rows, work_item,
)
from gemctl.ops.triton.mx_quant import _shared_exponent

LOG2E = 1.4426950408889634
# The kernels' window when there is none: every |distance| (< 2^30: lengths are int32 in-kernel)
# is below it, so the band arithmetic reduces to the plain causal / full ranges and the kernel
# signature stays the same for every call (the masked tiles pay one integer compare more).
NO_WINDOW = 1 << 30

# ----------------------------------------------------------------------------------------------
# Configs. (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates per head dim; the first call per
# (head dim, dtype, causal, bias, bucketed max length) times each and keeps the fastest
# (see pick_config). Under the interpreter one small config runs: speed is meaningless there and
# every config compiles the same code.
# A fifth field 1 = the unmasked K/V tiles by TMA (tensor descriptors; the masked ones by masked
# loads): it frees the address registers (sm_90 ptxas, D=128, no mask: 64x64 on 4 warps 255 -> 181
# registers, 128x64 on 8 warps 238 -> 204; causal with bias 64x32: 252 -> 178) at the same shared
# memory; 128x128 on 8 warps (FlashAttention 3's forward tile): 161 KiB shared, 225 KiB with the
# bias (sm_90; the limit per block is 227 KiB). Timed on the H200 at D=128 (2026-11-30,
# docs/benchmarks.md): TMA pays on the 64x32 tile only (the fastest forward at self-200/500/1000);
# 64x64, 128x64, 128x32 and 128x128 with TMA were 3-50% slower than the best plain tile and left
# the D=128 list.
# A sixth field 1 = lazy rescaling (see _fwd_tile): slower than its plain twin at every length
# timed (64x64 and 128x64 with TMA, self-200..1000); kept as a pinnable config (forced_config) for
# longer histories, where rescales get rarer, and out of the D=128 list.
_FWD_CANDIDATES = {
    "small": [(64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3, 1), (64, 32, 4, 3, 1),
              (64, 64, 4, 3, 1, 1)],
    "large": [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 3), (64, 32, 4, 3), (64, 32, 4, 3, 1),
              (64, 32, 4, 2, 1), (32, 32, 4, 3, 1)],
}
# The last two (not yet timed): 64x32 by TMA on 2 stages (49 KB of shared memory instead of 66,
# same 144 registers), and 32x32 for short histories (self-200: 73% of the computed scores valid
# instead of 63%; 32 rows are below a Hopper warpgroup MMA's 64, so ptxas gets mma.sync: 111
# registers on 4 warps).
# Backward passes are tuned separately: dK/dV holds a key tile and streams query tiles (wide key
# tiles amortize the K/V loads), dQ the reverse. dK/dV configs carry a fifth field: 1 = the
# transposed formulation (tiles of keys x queries, see _jagged_attn_bwd_dkdv), which at 128 keys x
# 64 queries on 8 warps spills 0.2 KB per thread instead of 2.7 KB (sm_90 ptxas, causal with bias).
# Every candidate timed on the H200 (2026-11-30, docs/benchmarks.md "dK/dV candidates"): 64 x 64
# untransposed is fastest at self-200 / self-1000, 32 x 64 transposed (4 warps) at self-500 and with
# causality and bias. The untransposed 32-query x 64-key tiles, (32, 64, 4, 3, 0) and (32, 64, 8, 2, 0), were
# dropped: their gradients differed from every other candidate's by up to 1.2 (bf16 values; the
# others agree bit for bit) although they passed the norm-wise accuracy test, and neither was the
# fastest anywhere.
# A sixth field 1 = the inner query tiles' Q and dO by TMA (fewer spills: 64x64 on 4 warps 176 ->
# 96 B, causal with bias 412 -> 220 B; on the H200 the whole backward 1-3% faster than without).
_DKDV_CANDIDATES = [(64, 64, 4, 2, 0), (32, 128, 4, 3, 0), (64, 128, 8, 2, 0),
                    (64, 128, 8, 2, 1), (32, 64, 4, 3, 1), (32, 64, 8, 2, 1),
                    (64, 64, 4, 2, 0, 1), (32, 64, 4, 3, 1, 1)]
_DKDV_INTERPRET = (16, 16, 1, 1, 0)
# With MX probabilities the key tiles hold whole MX blocks (32 keys): every GPU candidate does; the
# interpreter's 16-key tiles do not.
_MX_INTERPRET = (16, 32, 1, 1)
_DKDV_MX_INTERPRET = (16, 32, 1, 1, 0)
# A fifth field 1 = the inner K/V tiles by TMA (64x64 on 4 warps: spills 12 -> 0 B, causal with bias
# 164 -> 72 B; on the H200 within 1% of the plain 64x64; 128x64 with TMA was slower than without
# and was dropped).
_DQ_CANDIDATES = [(64, 64, 4, 2), (128, 32, 4, 3), (64, 32, 4, 3), (128, 64, 8, 2), (64, 32, 8, 3),
                  (64, 64, 4, 2, 1)]

# Configs with an optional field (TMA, lazy rescaling) set join autotuning once the GPU tier's
# every-candidate and fused-view tests have passed them. H200, 2026-11-30: the forward's 64x32 TMA
# tile (the fastest forward candidate at self-200/500/1000 in the sweep: 1.36x / 1.19x / 1.17x FA2
# varlen, docs/benchmarks.md) and the dK/dV TMA tiles (1-3% faster than without). The others stay
# pinned-only: lazy rescaling and 128x128 were slower than their plain twins everywhere in the sweep.
_GPU_CHECKED = {(64, 32, 4, 3, 1), (64, 64, 4, 2, 0, 1), (32, 64, 4, 3, 1, 1)}
_PENDING_AUTOTUNE = False  # True: autotuning times every candidate (benchmarks of unchecked ones)


def _tuned(candidates: list, first_optional: int) -> list:
    return gpu_checked(candidates, first_optional, _GPU_CHECKED, _PENDING_AUTOTUNE)


# ----------------------------------------------------------------------------------------------
@triton.jit
def _bias_tile(BIAS, h, dist, stride_bias_h, bias_max):
    # BIAS: per-distance bias [H, bias_max + 1] (fp32, already in log2 units); dist: int32 tile.
    ad = tl.minimum(tl.abs(dist), bias_max)
    return tl.load(BIAS + h * stride_bias_h + ad)


@triton.jit
def _bias_tile_table(BIAS, h, d0, stride_bias_h, bias_max, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     TRANS: tl.constexpr = False):
    # BIAS: the bias tiles of every tile offset d0 = m0 + shift - start_n (a multiple of
    # G = min(BLOCK_M, BLOCK_N) in self-attention), [H, NT, BLOCK_M, BLOCK_N] fp32 in log2 units,
    # tile t for d0 = D_LO + t * G (bias_tile_table builds it): a plain 2-D load, no gather.
    # TRANS: the (BLOCK_N, BLOCK_M) tiles of keys x queries, from the table stored [H, NT, BN, BM].
    G: tl.constexpr = BLOCK_M if BLOCK_M < BLOCK_N else BLOCK_N
    d_lo = -((bias_max + BLOCK_M + G - 1) // G) * G
    n_t = (((bias_max + BLOCK_N + G - 1) // G) * G - d_lo) // G + 1
    t = tl.minimum(tl.maximum((d0 - d_lo) // G, 0), n_t - 1)
    if TRANS:
        rows = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    else:
        rows = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    return tl.load(BIAS + h * stride_bias_h + t * (BLOCK_M * BLOCK_N) + rows)


# MXFP8 probabilities (operand_quant of gemctl.ops.jagged_attention, MX recipes): MX_P codes the
# element format and scale rule of P's quantization (0: none; see mx_p_code).
def mx_p_code(elem: torch.dtype, scale_rule: str, block: int) -> int:
    """The kernels' MX_P for an MX format (0 where they cannot: blocks other than 32)."""
    if block != 32 or elem not in (torch.float8_e4m3fn, torch.float8_e5m2) or scale_rule not in ("floor", "rceil"):
        return 0
    return (1 if elem == torch.float8_e4m3fn else 3) + (scale_rule == "rceil")


@triton.jit
def _mx_qdq_keys(p, KEY_AXIS: tl.constexpr, MX_P: tl.constexpr):
    """p (a 2-D fp32 tile, >= 0) MX-quantized and dequantized in blocks of 32 along KEY_AXIS (the
    tile's keys start at a multiple of 32 from the sequence's first key, so the blocks are those of
    the reference): shared exponent from each block's maximum (OCP floor, or RCEIL), elements
    rounded to nearest even and saturated (gemctl.precision.mx). MX_P: 1/2 E4M3 floor/RCEIL,
    3/4 E5M2 floor/RCEIL."""
    E5M2: tl.constexpr = MX_P >= 3
    RCEIL: tl.constexpr = MX_P % 2 == 0
    if E5M2:
        EMAX: tl.constexpr = 15
        ELEM_MAX: tl.constexpr = 57344.0
        DROP: tl.constexpr = 21
        MIN_NORMAL: tl.constexpr = 6.103515625e-05
        SUB_UNITS: tl.constexpr = 65536.0
    else:
        EMAX: tl.constexpr = 8
        ELEM_MAX: tl.constexpr = 448.0
        DROP: tl.constexpr = 20
        MIN_NORMAL: tl.constexpr = 0.015625
        SUB_UNITS: tl.constexpr = 512.0
    R: tl.constexpr = p.shape[0]
    C: tl.constexpr = p.shape[1]
    if KEY_AXIS == 1:
        x = tl.reshape(p, (R, C // 32, 32))
        amax_bits = tl.max(x.to(tl.int32, bitcast=True), axis=2)  # p >= 0: the bits order as the values
    else:
        x = tl.reshape(p, (R // 32, 32, C))
        amax_bits = tl.max(x.to(tl.int32, bitcast=True), axis=1)
    # -126, not the spec's -127: 2^-127 has no normal fp32 pattern. Only blocks whose maximum is
    # below 2^-118 (E4M3) / 2^-111 (E5M2) differ from gemctl.precision.mx, by ~1e-41.
    shared = tl.maximum(_shared_exponent(amax_bits, EMAX, RCEIL), -126)
    inv = ((127 - shared) << 23).to(tl.float32, bitcast=True)  # 2^-shared
    back = ((shared + 127) << 23).to(tl.float32, bitcast=True)  # 2^shared
    if KEY_AXIS == 1:
        inv, back = inv[:, :, None], back[:, :, None]
    else:
        inv, back = inv[:, None, :], back[:, None, :]
    a = tl.minimum(x * inv, ELEM_MAX)
    bits = a.to(tl.int32, bitcast=True)
    normal = ((bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) >> DROP) << DROP  # RNE to the element's mantissa
    sub = ((tl.minimum(a, MIN_NORMAL) * SUB_UNITS + 8388608.0) - 8388608.0) * (1.0 / SUB_UNITS)
    x = tl.where(a >= MIN_NORMAL, normal.to(tl.float32, bitcast=True), sub) * back
    return tl.reshape(x, (R, C))


@triton.jit
def _fwd_tile(
    acc, m_i, l_i, q, K, V, K_DESC, V_DESC, BIAS, h, k_start, start_n, k_len, shift,
    offs_m, offs_n, offs_d, stride_kn, stride_kh, stride_vn, stride_vh, stride_bias_h, bias_max, qk_scale, window,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, MASK: tl.constexpr, WINDOWED: tl.constexpr, MX_P: tl.constexpr = 0,
    TMA: tl.constexpr = False, FOLD_SCALE: tl.constexpr = False, LAZY: tl.constexpr = False, m0=0,
    BLOCK_M: tl.constexpr = 0, BLOCK_N: tl.constexpr = 0,
):
    # LAZY: FlashAttention 4's lazy rescaling: the accumulator is rescaled only in tiles where some
    # row's running maximum grows by more than 2^8 (log2 units); otherwise the stale maximum stays,
    # exactly (out = acc / l and lse = m + log2(l) use the same m), with p up to 256 meanwhile.
    # FOLD_SCALE (no bias, qk_scale > 0): s stays in raw q.k units, the row maximum is scaled once
    # (max(s) * c = max(s * c) for c > 0, bit for bit) and exp2(s * c - m) is one FMA per score,
    # instead of a multiply per score feeding both the maximum and the exponent.
    cols = start_n + offs_n  # key positions of this tile within the sequence
    kmask = cols < k_len
    if TMA and not MASK:  # a tile inside the sequence: K by TMA, no address arithmetic
        k = load_tile(K, K_DESC, k_start, start_n, cols, k_len, stride_kn, h * stride_kh, offs_d, True)
        s = tl.dot(q, tl.trans(k))  # (BM, BN)
    else:  # masked loads: rows past the sequence (another sequence's) read 0
        k = tl.load(K + (k_start + cols)[None, :] * stride_kn + h * stride_kh + offs_d[:, None], mask=kmask[None, :], other=0.0)  # (D, BN)
        s = tl.dot(q, k)  # (BM, BN)
    if not FOLD_SCALE:
        s = s * qk_scale  # log2 units
    v = load_tile(V, V_DESC, k_start, start_n, cols, k_len, stride_vn, h * stride_vh, offs_d,
              TMA and not MASK)  # (BN, D)
    dist = offs_m[:, None] + shift - cols[None, :]
    if HAS_BIAS == 2:  # self-attention: the tile's bias as one plain tile of a table
        s += _bias_tile_table(BIAS, h, m0 + shift - start_n, stride_bias_h, bias_max, BLOCK_M, BLOCK_N)
    elif HAS_BIAS:
        s += _bias_tile(BIAS, h, dist, stride_bias_h, bias_max)
    if MASK:
        s = tl.where(_visible(kmask[None, :], dist, window, CAUSAL, WINDOWED), s, float("-inf"))
    if FOLD_SCALE:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    if MX_P:  # an integer running maximum: rescaling by alpha is then a power of two, which MX
        m_new = tl.math.ceil(m_new)  # quantization commutes with (P relative to the final max)
    if LAZY:  # keep a row's maximum until it grows by more than 2^8 (p <= 256 meanwhile)
        grown = m_new > m_i + 8.0  # (any finite maximum against -inf)
        m_new = tl.where(grown, m_new, m_i)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    if FOLD_SCALE:
        p = tl.math.exp2(s * qk_scale - m_safe[:, None])
    else:
        p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)  # the unquantized sum: the normalizer
    if MX_P:
        p = _mx_qdq_keys(p, 1, MX_P)
    if LAZY:
        if tl.max(grown.to(tl.int32), 0) > 0:  # some row of the tile moved its maximum
            acc = acc * alpha[:, None]
        acc += tl.dot(p.to(v.dtype), v)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _visible(kmask, dist, window, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr):
    """Mask of visible (query, key) pairs, in dist's shape ((BM, BN), or (BN, BM) for the
    transposed tiles of the dK/dV pass); kmask: keys inside the sequence, shaped to broadcast
    against dist ((1, BN) or (BN, 1)); dist: aligned distance i + shift - j; window: NO_WINDOW when
    there is none (WINDOWED False skips the window compares)."""
    valid = kmask
    if WINDOWED:
        valid = valid & (dist < window)
    if CAUSAL:
        valid = valid & (dist >= 0)
    elif WINDOWED:
        valid = valid & (dist > -window)
    return valid


@triton.jit
def _row_block_range(m0, q_len, k_len, shift, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Key range of query rows [m0, m0 + BLOCK_M): every visible key lies in [lo, hi); the keys in
    [full_lo, full_end) are visible to every (valid) row of the tile and need no mask; [lo, full_lo)
    and [full_end, hi) do. lo, full_lo and full_end are multiples of BLOCK_N (or equal to hi)."""
    a_first = m0 + shift  # aligned position of the tile's first row
    a_last = tl.minimum(m0 + BLOCK_M, q_len) - 1 + shift  # ... and of its last valid row
    if CAUSAL:
        hi = tl.minimum(k_len, a_last + 1)  # keys visible to the tile's last row
        full_end = tl.minimum(k_len, a_first + 1)  # keys visible to its first row
    else:
        hi = tl.minimum(k_len, a_last + window)
        full_end = tl.minimum(k_len, a_first + window)
    lo = (tl.maximum(a_first - window + 1, 0) // BLOCK_N) * BLOCK_N  # the first row's oldest key
    full_lo = tl.maximum(a_last - window + 1, 0)  # the last row's oldest key
    full_lo = ((full_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, lo)
    full_end = (tl.maximum(full_end, 0) // BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(full_lo, hi)
    full_end = tl.maximum(tl.minimum(full_end, hi), full_lo)
    return lo, full_lo, full_end, hi


@triton.jit
def _jagged_attn_fwd(
    Q, K, V, O, LSE, MROW, Q_OFFSETS, K_OFFSETS, WORK, BIAS, K_DESC, V_DESC,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh,
    stride_bias_h, bias_max, num_heads, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, WINDOWED: tl.constexpr = False, MX_P: tl.constexpr = 0,
    TMA: tl.constexpr = False, FOLD_SCALE: tl.constexpr = False, LAZY: tl.constexpr = False,
):
    # FOLD_SCALE, LAZY: see _fwd_tile (set by the host without a bias when qk_scale > 0).
    # TMA: K_DESC / V_DESC are tensor descriptors over K / V viewed as [Nk, H * D] with
    # (BLOCK_N, D) blocks; the tiles that need no mask (all inside the sequence) come through them,
    # the masked ones (partial, diagonal, band edge) by masked loads as without TMA.
    # MX_P: the probabilities MX-quantized in blocks of 32 keys before the PV product (_mx_qdq_keys),
    # relative to an integer running maximum whose final value goes to MROW [Nq, H] fp32.
    # window: the sliding window (NO_WINDOW: none). WINDOWED=False compiles the no-window kernel
    # without the band's leading-edge loop and window compares (it measured ~10% faster).
    # Q/K/V/O: [N, H, D] jagged values; LSE: [Nq, H] fp32 log2-sum-exp2 per row (for backward);
    # Q_OFFSETS/K_OFFSETS: int64 [B+1]; WORK: int32 [n_work, 2] = (sequence, query tile).
    # Program (pid, h) computes BLOCK_M query rows of one sequence for head h.
    pid = tl.program_id(0)
    h = tl.program_id(1)
    m0, q_start, q_len, k_start, k_len, shift = work_item(WORK, Q_OFFSETS, K_OFFSETS, pid, BLOCK_M)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len
    q = load_rows(Q, q_start, offs_m, q_len, stride_qn, h * stride_qh, offs_d)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    lo, full_lo, full_end, hi = _row_block_range(m0, q_len, k_len, shift, window, BLOCK_M, BLOCK_N, CAUSAL)
    # Window band's leading edge (masked), the tiles every row sees (no mask), the trailing edge.
    # Without a window lo = full_lo = 0: the first loop is not compiled.
    if WINDOWED:
        for start_n in range(lo, full_lo, BLOCK_N):
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, K, V, K_DESC, V_DESC, BIAS, h, k_start, start_n, k_len, shift,
                                      offs_m, offs_n, offs_d, stride_kn, stride_kh, stride_vn, stride_vh,
                                      stride_bias_h, bias_max, qk_scale, window, CAUSAL, HAS_BIAS, True, True, MX_P,
                                      TMA, FOLD_SCALE, LAZY, m0, BLOCK_M, BLOCK_N)
    for start_n in range(full_lo, full_end, BLOCK_N):
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, K, V, K_DESC, V_DESC, BIAS, h, k_start, start_n, k_len, shift,
                                  offs_m, offs_n, offs_d, stride_kn, stride_kh, stride_vn, stride_vh,
                                  stride_bias_h, bias_max, qk_scale, window, CAUSAL, HAS_BIAS, False, WINDOWED, MX_P,
                                  TMA, FOLD_SCALE, LAZY, m0, BLOCK_M, BLOCK_N)
    for start_n in range(full_end, hi, BLOCK_N):
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, K, V, K_DESC, V_DESC, BIAS, h, k_start, start_n, k_len, shift,
                                  offs_m, offs_n, offs_d, stride_kn, stride_kh, stride_vn, stride_vh,
                                  stride_bias_h, bias_max, qk_scale, window, CAUSAL, HAS_BIAS, True, WINDOWED, MX_P,
                                  TMA, FOLD_SCALE, LAZY, m0, BLOCK_M, BLOCK_N)
    has_key = l_i > 0.0
    l_safe = tl.where(has_key, l_i, 1.0)
    out = acc / l_safe[:, None]  # rows with no visible key: acc = 0 -> zeros
    lse = tl.where(has_key, m_i + tl.math.log2(l_safe), float("inf"))  # +inf: p = 0 in backward
    store_rows(O, out, q_start, offs_m, q_len, stride_on, h * stride_oh, offs_d)
    tl.store(LSE + (q_start + offs_m) * num_heads + h, lse, mask=row_ok)
    if MX_P:
        tl.store(MROW + (q_start + offs_m) * num_heads + h, tl.where(has_key, m_i, 0.0), mask=row_ok)


@triton.jit
def _bwd_scores(q, k, BIAS, h, dist, lse, stride_bias_h, bias_max, qk_scale, valid,
                HAS_BIAS: tl.constexpr, MASK: tl.constexpr, d0=0, BLOCK_M: tl.constexpr = 0,
                BLOCK_N: tl.constexpr = 0):
    """Recompute p = softmax probabilities of a (BM, BN) tile from q, k and the saved LSE; also
    the scores s (log2 units, bias included; HAS_BIAS == 2: the tile of offset d0 from the table)."""
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if HAS_BIAS == 2:
        s += _bias_tile_table(BIAS, h, d0, stride_bias_h, bias_max, BLOCK_M, BLOCK_N)
    elif HAS_BIAS:
        s += _bias_tile(BIAS, h, dist, stride_bias_h, bias_max)
    p = tl.math.exp2(s - lse[:, None])
    if MASK:
        p = tl.where(valid, p, 0.0)
    return p, s


@triton.jit
def _jagged_attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, MROW, Q_OFFSETS, K_OFFSETS, WORK, BIAS, Q_DESC, DO_DESC,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_don, stride_doh, stride_dkn, stride_dkh, stride_dvn, stride_dvh,
    stride_bias_h, bias_max, num_heads, qk_scale, scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, TRANSPOSED: tl.constexpr, MX_P: tl.constexpr = 0,
    TMA: tl.constexpr = False,
):
    # WORK: int32 [n_work, 2] = (sequence, key tile). Program (pid, h) owns BLOCK_N keys of one
    # sequence and loops over the query tiles that see them: dK, dV written once, no atomics.
    # TRANSPOSED computes the (BLOCK_N, BLOCK_M) tiles s^T = k q^T, p^T, dS^T directly: they leave
    # their MMAs in the layout the next MMA (dv += p^T do, dk += dS^T q) takes as its A operand,
    # so no register tile goes through shared memory to be transposed, and the key tile is the
    # MMA's M side (128 keys on 8 warps = two warp groups of 64 rows, FlashAttention's dK/dV shape).
    # MX_P: dV takes the forward's quantized probabilities, q(exp2(s - M)) / l with M the row's
    # integer maximum (MROW) and 1/l = exp2(M - lse); dS takes the unquantized ones (straight through).
    pid = tl.program_id(0)
    h = tl.program_id(1)
    n0, q_start, q_len, k_start, k_len, shift = work_item(WORK, Q_OFFSETS, K_OFFSETS, pid, BLOCK_N)

    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kmask = offs_n < k_len
    k = load_rows(K, k_start, offs_n, k_len, stride_kn, h * stride_kh, offs_d)
    v = load_rows(V, k_start, offs_n, k_len, stride_vn, h * stride_vh, offs_d)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    # Query rows i (aligned position a = i + shift) that see a key j of this tile: a >= j (causal),
    # a < j + window and a > j - window (window). Rows in [i_lo, i_hi) see some key of the tile,
    # rows in [full_i_lo, full_i_hi) see all of them. A partial key tile is masked everywhere.
    n_last = n0 + BLOCK_N - 1
    if CAUSAL:
        i_lo = n0 - shift
        full_i_lo = n_last - shift
    else:
        i_lo = n0 - window + 1 - shift
        full_i_lo = n_last - window + 1 - shift
    i_hi = tl.minimum(n_last + window - shift, q_len)
    full_i_hi = n0 + window - shift
    lo = (tl.maximum(i_lo, 0) // BLOCK_M) * BLOCK_M
    stop = tl.maximum(i_hi, lo)
    full_start = ((tl.maximum(full_i_lo, 0) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    # Rows from q_len on read lse = +inf (p = 0), so the last partial query tile needs no mask.
    full_stop = tl.where(full_i_hi >= q_len, q_len, (tl.maximum(full_i_hi, 0) // BLOCK_M) * BLOCK_M)
    if n0 + BLOCK_N > k_len:
        full_start = stop  # every query tile masked
    full_start = tl.maximum(tl.minimum(full_start, stop), lo)
    if TMA:  # Q and dO of the inner tiles come by TMA (Q_DESC, DO_DESC over [Nq, H * D]): only
        full_stop = tl.minimum(full_stop, (q_len // BLOCK_M) * BLOCK_M)  # whole query tiles there
    full_stop = tl.maximum(tl.minimum(full_stop, stop), full_start)

    for phase in tl.static_range(3):  # leading edge (masked), inner tiles (no mask), trailing edge
        if phase == 0:
            start, end = lo, full_start
        elif phase == 1:
            start, end = full_start, full_stop
        else:
            start, end = full_stop, stop
        for start_m in range(start, end, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < q_len
            by_tma: tl.constexpr = TMA and phase == 1
            q = load_tile(Q, Q_DESC, q_start, start_m, offs_m, q_len, stride_qn, h * stride_qh, offs_d, by_tma)
            do = load_tile(DO, DO_DESC, q_start, start_m, offs_m, q_len, stride_don, h * stride_doh, offs_d, by_tma)
            lse = tl.load(LSE + (q_start + offs_m) * num_heads + h, mask=row_ok, other=float("inf"))
            delta = tl.load(DELTA + (q_start + offs_m) * num_heads + h, mask=row_ok, other=0.0)
            if MX_P:
                m_row = tl.load(MROW + (q_start + offs_m) * num_heads + h, mask=row_ok, other=0.0)
                inv_l = tl.math.exp2(tl.where(row_ok, m_row - lse, float("-inf")))  # 1 / l; 0 past the rows
            if TRANSPOSED:  # q^T and do^T are views of the tiles staged in shared memory
                dist_t = offs_m[None, :] + shift - offs_n[:, None]
                s_t = tl.dot(k, tl.trans(q)) * qk_scale
                if HAS_BIAS == 2:
                    s_t += _bias_tile_table(BIAS, h, start_m + shift - n0, stride_bias_h, bias_max, BLOCK_M, BLOCK_N,
                                            True)
                elif HAS_BIAS:
                    s_t += _bias_tile(BIAS, h, dist_t, stride_bias_h, bias_max)
                p_t = tl.math.exp2(s_t - lse[None, :])
                if phase != 1:
                    valid_t = _visible(kmask[:, None], dist_t, window, CAUSAL, True)
                    p_t = tl.where(valid_t, p_t, 0.0)
                if MX_P:
                    pq_t = tl.where(row_ok[None, :], tl.math.exp2(s_t - m_row[None, :]), 0.0)
                    if phase != 1:
                        pq_t = tl.where(valid_t, pq_t, 0.0)
                    pq_t = _mx_qdq_keys(pq_t, 0, MX_P) * inv_l[None, :]
                    dv += tl.dot(pq_t.to(do.dtype), do)
                else:
                    dv += tl.dot(p_t.to(do.dtype), do)
                ds_t = p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])
                dk += tl.dot(ds_t.to(q.dtype), q)
            else:
                dist = offs_m[:, None] + shift - offs_n[None, :]
                valid = _visible(kmask[None, :], dist, window, CAUSAL, True)
                p, s = _bwd_scores(q, k, BIAS, h, dist, lse, stride_bias_h, bias_max, qk_scale, valid, HAS_BIAS,
                                   phase != 1, start_m + shift - n0, BLOCK_M, BLOCK_N)
                if MX_P:
                    pq = tl.where(row_ok[:, None], tl.math.exp2(s - m_row[:, None]), 0.0)
                    if phase != 1:
                        pq = tl.where(valid, pq, 0.0)
                    pq = _mx_qdq_keys(pq, 1, MX_P) * inv_l[:, None]
                    dv += tl.dot(tl.trans(pq.to(do.dtype)), do)
                else:
                    dv += tl.dot(tl.trans(p.to(do.dtype)), do)
                ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    store_rows(DK, dk * scale, k_start, offs_n, k_len, stride_dkn, h * stride_dkh, offs_d)
    store_rows(DV, dv, k_start, offs_n, k_len, stride_dvn, h * stride_dvh, offs_d)


# A tile spanning more buckets than this reduces ds along its diagonals first (_dbias_tile).
_DBIAS_DIAGONAL_MIN = tl.constexpr(4)


@triton.jit
def _dbias_masked(ds, dist, BUCKETS, bias_max, bucket_ids, b_lo, b_hi):
    """One masked sum of ds per bucket in [b_lo, b_hi], as a [NUM_BUCKETS] vector."""
    tile_bucket = tl.load(BUCKETS + tl.minimum(tl.abs(dist), bias_max))
    out = tl.zeros(bucket_ids.shape, dtype=tl.float32)
    for bkt in range(b_lo, b_hi + 1):
        part = tl.sum(tl.sum(tl.where(tile_bucket == bkt, ds, 0.0), 1), 0)
        out += tl.where(bucket_ids == bkt, part, 0.0)
    return out


@triton.jit
def _dbias_tile(ds, dist, d0, BUCKETS, bias_max, bucket_ids, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                DIAG: tl.constexpr = True):
    """The bias-table gradient of one (BM, BN) tile of ds (rows past the sequence zeroed): the sum of
    ds over each bucket, as a [NUM_BUCKETS] vector. dist = d0 + a - b (row a, column b), so |distance|
    spans a contiguous range of the tile and its buckets do too. One bucket (far from the diagonal):
    one sum. A few: one masked sum per bucket. Many (near the diagonal, up to NUM_BUCKETS): the
    tile's diagonals are summed first (each holds one distance) and the 2 * BM diagonal sums go to
    their buckets, a cost independent of how many buckets the tile spans."""
    d_lo = d0 - (BLOCK_N - 1)
    d_hi = d0 + BLOCK_M - 1
    ad_lo = tl.where((d_lo <= 0) & (d_hi >= 0), 0, tl.minimum(tl.abs(d_lo), tl.abs(d_hi)))
    ad_hi = tl.maximum(tl.abs(d_lo), tl.abs(d_hi))
    b_lo = tl.load(BUCKETS + tl.minimum(ad_lo, bias_max))
    b_hi = tl.load(BUCKETS + tl.minimum(ad_hi, bias_max))
    out = tl.zeros(bucket_ids.shape, dtype=tl.float32)
    if b_lo == b_hi:
        out = tl.where(bucket_ids == b_lo, tl.sum(tl.sum(ds, 1), 0), 0.0)
    elif not DIAG or BLOCK_M < BLOCK_N:  # compile-time: the skew below is not built at all
        out = _dbias_masked(ds, dist, BUCKETS, bias_max, bucket_ids, b_lo, b_hi)
    elif b_hi - b_lo < _DBIAS_DIAGONAL_MIN:
        out = _dbias_masked(ds, dist, BUCKETS, bias_max, bucket_ids, b_lo, b_hi)
    else:
        # Skew the tile along its rows (BM >= BN: at most one wrap): y[i, b] = ds[(i + b) % BM, b]
        # lies on diagonal a - b = i, or i - BM where it wrapped; row sums of y are diagonal sums.
        rows = tl.arange(0, BLOCK_M)
        turn = rows[:, None] + tl.arange(0, BLOCK_N)[None, :]
        wrapped = turn >= BLOCK_M
        y = tl.gather(ds, tl.where(wrapped, turn - BLOCK_M, turn), 0)
        on_i = tl.sum(tl.where(wrapped, 0.0, y), 1)  # distance d0 + i
        on_i_less = tl.sum(tl.where(wrapped, y, 0.0), 1)  # distance d0 + i - BM
        b_i = tl.load(BUCKETS + tl.minimum(tl.abs(d0 + rows), bias_max))
        b_i_less = tl.load(BUCKETS + tl.minimum(tl.abs(d0 + rows - BLOCK_M), bias_max))
        out = tl.sum(tl.where(b_i[:, None] == bucket_ids[None, :], on_i[:, None], 0.0), 0)
        out += tl.sum(tl.where(b_i_less[:, None] == bucket_ids[None, :], on_i_less[:, None], 0.0), 0)
    return out


@triton.jit
def _jagged_attn_bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ, DBIAS, Q_OFFSETS, K_OFFSETS, WORK, BIAS, BUCKETS, K_DESC, V_DESC,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_don, stride_doh, stride_dqn, stride_dqh,
    stride_bias_h, bias_max, num_heads, qk_scale, scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, NUM_BUCKETS: tl.constexpr, TMA: tl.constexpr = False,
    DBIAS_DIAG: tl.constexpr = True,
):
    # WORK: (sequence, query tile) as in the forward. DBIAS: fp32 [n_work, H, NUM_BUCKETS]
    # partial bias gradients, one row per program (summed on the host side in a fixed order).
    # BUCKETS: int32 [bias_max + 1] bucket of each |distance|.
    pid = tl.program_id(0)
    h = tl.program_id(1)
    m0, q_start, q_len, k_start, k_len, shift = work_item(WORK, Q_OFFSETS, K_OFFSETS, pid, BLOCK_M)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len
    q = load_rows(Q, q_start, offs_m, q_len, stride_qn, h * stride_qh, offs_d)
    do = load_rows(DO, q_start, offs_m, q_len, stride_don, h * stride_doh, offs_d)
    lse = tl.load(LSE + (q_start + offs_m) * num_heads + h, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + (q_start + offs_m) * num_heads + h, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    bucket_ids = tl.arange(0, NUM_BUCKETS)
    dbias = tl.zeros([NUM_BUCKETS], dtype=tl.float32)

    lo, full_lo, full_end, hi = _row_block_range(m0, q_len, k_len, shift, window, BLOCK_M, BLOCK_N, CAUSAL)
    for phase in tl.static_range(3):  # leading edge (masked), inner tiles (no mask), trailing edge
        if phase == 0:
            start, stop = lo, full_lo
        elif phase == 1:
            start, stop = full_lo, full_end
        else:
            start, stop = full_end, hi
        for start_n in range(start, stop, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            kmask = offs_n < k_len
            # TMA (K_DESC, V_DESC over [Nk, H * D]) for the unmasked tiles: all inside the sequence
            by_tma: tl.constexpr = TMA and phase == 1
            k = load_tile(K, K_DESC, k_start, start_n, offs_n, k_len, stride_kn, h * stride_kh, offs_d, by_tma)
            v = load_tile(V, V_DESC, k_start, start_n, offs_n, k_len, stride_vn, h * stride_vh, offs_d, by_tma)
            dist = offs_m[:, None] + shift - offs_n[None, :]
            valid = _visible(kmask[None, :], dist, window, CAUSAL, True)
            p, _ = _bwd_scores(q, k, BIAS, h, dist, lse, stride_bias_h, bias_max, qk_scale, valid, HAS_BIAS, phase != 1,
                               m0 + shift - start_n, BLOCK_M, BLOCK_N)
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None])  # gradient of the natural-units score s_ij
            dq += tl.dot(ds.to(k.dtype), k)
            if HAS_BIAS:
                dbias += _dbias_tile(tl.where(row_ok[:, None], ds, 0.0), dist, m0 + shift - start_n, BUCKETS, bias_max,
                                     bucket_ids, BLOCK_M, BLOCK_N, DBIAS_DIAG)
    store_rows(DQ, dq * scale, q_start, offs_m, q_len, stride_dqn, h * stride_dqh, offs_d)
    if HAS_BIAS:
        tl.store(DBIAS + (pid * num_heads + h) * NUM_BUCKETS + bucket_ids, dbias)


@triton.jit(do_not_specialize=["n_rows"])  # per-batch sizes: common.py, "Specialization"
def _bwd_delta(O, DO, DELTA, n_rows, num_heads, stride_on, stride_oh, stride_don, stride_doh,
               HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr):
    # DELTA: fp32 [N, H] = rowsum(dO * O) per row and head (the softmax backward's correction),
    # read once from O and dO: one pass instead of torch's casts, product and sum (five passes
    # over fp32 copies). Program (pid, h): BLOCK_R rows of head h.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = rows < n_rows
    o = tl.load(O + rows[:, None] * stride_on + h * stride_oh + offs_d[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(DO + rows[:, None] * stride_don + h * stride_doh + offs_d[None, :], mask=ok[:, None], other=0.0)
    tl.store(DELTA + rows * num_heads + h, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=ok)


# ----------------------------------------------------------------------------------------------
# Host side: work lists, configs, launchers.


_DELTA_ROWS = 64  # rows per program of _bwd_delta
_NO_BIAS: dict = {}  # device -> the no-bias placeholders (two fills a call were ~10% of self-200's host time)
_BUCKETS: dict = {}  # (max_distance, buckets, device) -> bucket of each |distance| (int64, int32): fixed per layer


def _bias_tables(bias: RelativePositionBias | None, num_heads: int, device):
    """Per-|distance| bias in log2 units [H, max_distance + 1] and the bucket of each |distance|."""
    if bias is None:  # placeholders the kernels never read: made once per device, not per call
        if device not in _NO_BIAS:
            _NO_BIAS[device] = (torch.zeros(1, 1, device=device, dtype=torch.float32),
                                torch.zeros(1, device=device, dtype=torch.int32))
        return *_NO_BIAS[device], 0, 1
    max_d = int(bias.max_distance)
    key = (max_d, bias.num_buckets, device)
    if key not in _BUCKETS:  # ~10 small kernels a call before (the bucket law's log, floor, clamps)
        if len(_BUCKETS) >= 8:
            _BUCKETS.pop(next(iter(_BUCKETS)))
        buckets = relative_position_bucket(torch.arange(max_d + 1, device=device), bias.num_buckets, max_d)
        _BUCKETS[key] = (buckets, buckets.to(torch.int32).contiguous())
    buckets, buckets32 = _BUCKETS[key]
    per_distance = torch.index_select(bias.table.detach().float(), 1, buckets).mul_(LOG2E)
    return per_distance, buckets32, max_d, bias.num_buckets


_BIAS_TILES = True  # self-attention forwards read the bias as plain tiles (bias_tile_table); False: gathers
# The backward passes (dK/dV straight or transposed, dQ) the same way, bit for bit the gathers'
# (1.74-1.94x on the H200 with the diagonal sums below, docs/benchmarks.md).
_BIAS_TILES_BWD: bool | str = True  # True: both passes; "dkdv" or "dq": that pass only
_tile_index_cache: dict = {}  # (max_d, BM, BN, device) -> int32 |distance| index [NT, BM, BN]
_TILE_INDEX_ENTRIES = 16  # autotuning builds one per candidate tile shape; older entries are dropped
# A launch whose table would exceed this many bytes gathers instead (H * NT * BM * BN * 4 bytes grows
# with heads and max_distance: 16 heads at max_distance 2048 take ~17-36 MB with the tile shapes of
# the candidates; a table is built per call).
_BIAS_TILE_BYTES = 64 << 20
# The dQ pass's bias gradient sums a tile spanning many buckets along its diagonals first
# (_dbias_tile); False: one masked sum per bucket, as before.
_DBIAS_DIAG = True


def _tile_table_span(max_d: int, block_m: int, block_n: int) -> tuple[int, int, int]:
    """(G, D_LO, NT) of a bias tile table, as _bias_tile_table computes them in the kernel."""
    g = min(block_m, block_n)
    d_lo = -cdiv(max_d + block_m, g) * g
    return g, d_lo, (cdiv(max_d + block_n, g) * g - d_lo) // g + 1


def _tile_table_bytes(heads: int, max_d: int, block_m: int, block_n: int) -> int:
    return heads * _tile_table_span(max_d, block_m, block_n)[2] * block_m * block_n * 4


def bias_tile_table(per_distance: torch.Tensor, max_d: int, block_m: int, block_n: int,
                    transposed: bool = False) -> torch.Tensor:
    """The bias tiles [H, NT, BM, BN] (fp32, log2 units) from the per-|distance| table
    [H, max_d + 1]: tile t holds bias(|d0 + a - b|) for row a, column b and d0 = D_LO + t * G
    (G = min(BM, BN)), every tile offset a self-attention tile (m0 - start_n, both multiples of
    their tile) can have, D_LO and NT as _bias_tile_table computes them; the end tiles are
    constant (every |distance| beyond max_d), so offsets past them clamp to them. ``transposed``:
    each tile stored [BN, BM] (the dK/dV pass's keys x queries), gathered so directly."""
    key = (max_d, block_m, block_n, transposed, per_distance.device)
    if key not in _tile_index_cache:
        if len(_tile_index_cache) >= _TILE_INDEX_ENTRIES:
            _tile_index_cache.pop(next(iter(_tile_index_cache)))
        g, d_lo, n_t = _tile_table_span(max_d, block_m, block_n)
        d0 = d_lo + g * torch.arange(n_t, device=per_distance.device, dtype=torch.int32)
        a = torch.arange(block_m, device=per_distance.device, dtype=torch.int32)
        b = torch.arange(block_n, device=per_distance.device, dtype=torch.int32)
        dist = d0[:, None, None] + a[None, :, None] - b[None, None, :]
        index = dist.abs().clamp(max=max_d)
        _tile_index_cache[key] = index.transpose(1, 2).contiguous() if transposed else index
    return per_distance[:, _tile_index_cache[key]].contiguous()


def _bias_operand(per_distance, max_d: int, heads: int, block_m: int, block_n: int, has_bias: bool, tiles: bool,
                  transposed: bool = False):
    """(the BIAS tensor, HAS_BIAS) of one launch: the tile table (HAS_BIAS 2) where ``tiles`` allows it
    and the table stays within _BIAS_TILE_BYTES, else the per-distance table for gathers."""
    if tiles and _tile_table_bytes(heads, max_d, block_m, block_n) <= _BIAS_TILE_BYTES:
        return bias_tile_table(per_distance, max_d, block_m, block_n, transposed), 2
    return per_distance, has_bias


def _check_mx_tile(mx_p: int, block_n: int) -> None:
    if mx_p and block_n % 32:
        raise ValueError(f"jagged_attention: MX probabilities need key tiles of whole 32-key blocks, got BLOCK_N={block_n}")


def _forward(q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, bias, causal, scale, window, mx_p=0):
    n_q, heads, dim = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(n_q, heads, device=q.device, dtype=torch.float32)
    mrow = torch.empty(n_q if mx_p else 0, heads, device=q.device, dtype=torch.float32)
    bias_d, _, bias_max, _ = _bias_tables(bias, heads, q.device)
    qk_scale = scale * LOG2E
    kernel_window = window if window > 0 else NO_WINDOW
    # self-attention (one layout for queries and keys): every sequence's shift is 0, so every tile
    # offset is a multiple of G
    tiles = _BIAS_TILES and bias is not None and same_offsets(q_offsets, k_offsets)

    def run(cfg):
        bm, bn, warps, stages = cfg[:4]
        _check_mx_tile(mx_p, bn)
        work = query_work(q_offsets, k_offsets, bm, causal, q.device)
        if work.shape[0] == 0:
            return
        # Where the descriptors cannot be built the same tiles run by masked loads (same values).
        descs = row_descriptors(bn, k, v) if config_field(cfg, 4) else None
        bias_t, has_bias = _bias_operand(bias_d, bias_max, heads, bm, bn, bias is not None, tiles)
        _jagged_attn_fwd[(work.shape[0], heads)](
            q, k, v, out, lse, mrow if mx_p else lse, q_offsets, k_offsets, work, bias_t, *(descs or (None, None)),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
            bias_t.stride(0), bias_max, heads, qk_scale, kernel_window,
            HEAD_DIM=dim, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, HAS_BIAS=has_bias, WINDOWED=window > 0,
            MX_P=mx_p, TMA=descs is not None, FOLD_SCALE=bias is None and qk_scale > 0, LAZY=bool(config_field(cfg, 5)),
            num_warps=warps, num_stages=stages,
        )

    size = "large" if dim >= 128 else "small"
    bias_kind = 2 if tiles else bias is not None  # gathers and tiles: configs timed apart (bools as before)
    key = ("fwd", dim, q.dtype, causal, bias_kind, _window_key(window), bucket_len(max_q_len), bucket_len(max_k_len),
           mx_p)
    run(pick_config(key, lambda: _tuned(_FWD_CANDIDATES[size], 4), run,
                    **({"interpret_config": _MX_INTERPRET} if mx_p else {})))
    return out, lse, mrow


def _backward(do, q, k, v, out, lse, q_offsets, k_offsets, max_q_len, max_k_len, bias, causal, scale, window,
              mrow=None, mx_p=0):
    n_q, heads, dim = q.shape
    do = do.contiguous()
    delta = torch.empty(n_q, heads, device=q.device, dtype=torch.float32)  # (Nq, H) rowsum(dO * O)
    if n_q:
        _bwd_delta[(cdiv(n_q, _DELTA_ROWS), heads)](
            out, do, delta, n_q, heads, out.stride(0), out.stride(1), do.stride(0), do.stride(1),
            HEAD_DIM=dim, BLOCK_R=_DELTA_ROWS, num_warps=4,
        )
    # No zero fills where the kernels write every row: the dQ pass has a program for every query
    # tile (rows that see no key store zeros), the dK/dV pass one for every key tile, those of
    # sequences without queries included (they store zeros). Rows past the offsets' last entry
    # belong to no sequence: zeros then.
    whole = int(host.host_of(q_offsets)[-1]) == n_q and int(host.host_of(k_offsets)[-1]) == k.shape[0]
    alloc = torch.empty_like if whole else torch.zeros_like
    dq, dk, dv = alloc(q), alloc(k), alloc(v)
    bias_d, buckets, bias_max, n_buckets = _bias_tables(bias, heads, q.device)
    nb_pad = max(16, next_pow2(n_buckets))
    qk_scale = scale * LOG2E
    has_bias = bias is not None
    # the bias as tiles (see _forward) in self-attention, where _BIAS_TILES_BWD allows it
    self_attention = has_bias and same_offsets(q_offsets, k_offsets)
    assert _BIAS_TILES_BWD in (True, False, "dkdv", "dq"), f"_BIAS_TILES_BWD={_BIAS_TILES_BWD!r}"
    tiles_dkdv, tiles_dq = (self_attention and _BIAS_TILES_BWD in (True, name) for name in ("dkdv", "dq"))
    bias_kind = (2 if tiles_dkdv else has_bias, 2 if tiles_dq else has_bias)  # the autotune keys' bias field
    kernel_window = window if window > 0 else NO_WINDOW
    state = {}

    def run_dkdv(cfg):
        bm, bn, warps, stages, transposed = cfg[:5]
        _check_mx_tile(mx_p, bn)
        kwork = key_work(q_offsets, k_offsets, bn, causal, q.device, include_empty=True)
        descs = row_descriptors(bm, q, do) if config_field(cfg, 5) else None
        # the transposed formulation reads (BN, BM) tiles of keys x queries
        bias_t, kind = _bias_operand(bias_d, bias_max, heads, bm, bn, has_bias, tiles_dkdv, bool(transposed))
        if kwork.shape[0]:
            _jagged_attn_bwd_dkdv[(kwork.shape[0], heads)](
                q, k, v, do, lse, delta, dk, dv, mrow if mx_p else lse, q_offsets, k_offsets, kwork, bias_t,
                *(descs or (None, None)),
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
                bias_t.stride(0), bias_max, heads, qk_scale, scale, kernel_window,
                HEAD_DIM=dim, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, HAS_BIAS=kind, TRANSPOSED=bool(transposed),
                MX_P=mx_p, TMA=descs is not None, num_warps=warps, num_stages=stages,
            )

    def run_dq(cfg):
        bm, bn, warps, stages = cfg[:4]
        qwork = query_work(q_offsets, k_offsets, bm, causal, q.device)
        # per-program partial bias gradients; without a bias the kernel stores none (a placeholder)
        dbias = (torch.zeros(max(qwork.shape[0], 1), heads, nb_pad, device=q.device, dtype=torch.float32)
                 if has_bias else bias_d)
        descs = row_descriptors(bn, k, v) if config_field(cfg, 4) else None
        bias_t, kind = _bias_operand(bias_d, bias_max, heads, bm, bn, has_bias, tiles_dq)
        if qwork.shape[0]:
            _jagged_attn_bwd_dq[(qwork.shape[0], heads)](
                q, k, v, do, lse, delta, dq, dbias, q_offsets, k_offsets, qwork, bias_t, buckets,
                *(descs or (None, None)),
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                do.stride(0), do.stride(1), dq.stride(0), dq.stride(1),
                bias_t.stride(0), bias_max, heads, qk_scale, scale, kernel_window,
                HEAD_DIM=dim, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, HAS_BIAS=kind, NUM_BUCKETS=nb_pad,
                TMA=descs is not None, DBIAS_DIAG=_DBIAS_DIAG, num_warps=warps, num_stages=stages,
            )
        state["dbias"] = dbias

    def key(kind):
        return (dim, q.dtype, causal, kind, _window_key(window), bucket_len(max_q_len), bucket_len(max_k_len))

    run_dkdv(pick_config(("dkdv",) + key(bias_kind[0]) + (mx_p,), lambda: _tuned(_DKDV_CANDIDATES, 5), run_dkdv,
                         _DKDV_MX_INTERPRET if mx_p else _DKDV_INTERPRET))
    run_dq(pick_config(("dq",) + key(bias_kind[1]) + (bool(_DBIAS_DIAG) and has_bias,),
                       lambda: _tuned(_DQ_CANDIDATES, 4), run_dq))
    dtable = None
    if has_bias:
        dtable = state["dbias"].sum(0)[:, :n_buckets].to(bias.table.dtype)  # fixed-order reduction
    return dq, dk, dv, dtable


def _window_key(window: int) -> int:
    """Autotune key of a window (0: none): its power-of-two bucket, like the lengths."""
    return bucket_len(window) if window > 0 else 0


# torch.library custom ops with fakes: torch.compile traces through them without a graph break,
# and autograd is attached with register_autograd.
@torch.library.custom_op("gemctl::jagged_attention_fwd", mutates_args=())
def _jagged_attention_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor | None,
    q_offsets: torch.Tensor, k_offsets: torch.Tensor, max_q_len: int, max_k_len: int,
    max_distance: int, causal: bool, scale: float, window: int, mx_p: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bias = None if table is None else RelativePositionBias(table, max_distance)
    # Any row/head strides work (the q, k, v views of a fused QKV projection need no copy); the
    # head dimension must be contiguous.
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return _forward(q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, bias, causal, scale, window, mx_p)


@_jagged_attention_fwd_op.register_fake
def _(q, k, v, table, q_offsets, k_offsets, max_q_len, max_k_len, max_distance, causal, scale, window, mx_p):
    rows = q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)
    return torch.empty_like(q), rows, q.new_empty(q.shape[0] if mx_p else 0, q.shape[1], dtype=torch.float32)


@torch.library.custom_op("gemctl::jagged_attention_bwd", mutates_args=())
def _jagged_attention_bwd_op(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, mrow: torch.Tensor, table: torch.Tensor | None, q_offsets: torch.Tensor,
    k_offsets: torch.Tensor, max_q_len: int, max_k_len: int, max_distance: int, causal: bool, scale: float,
    window: int, mx_p: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    bias = None if table is None else RelativePositionBias(table, max_distance)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    dq, dk, dv, dtable = _backward(
        do, q, k, v, out, lse, q_offsets, k_offsets, max_q_len, max_k_len, bias, causal, scale, window, mrow, mx_p
    )
    return dq, dk, dv, dtable if dtable is not None else q.new_empty(0)


@_jagged_attention_bwd_op.register_fake
def _(do, q, k, v, out, lse, mrow, table, q_offsets, k_offsets, max_q_len, max_k_len, max_distance, causal, scale,
      window, mx_p):
    dtable = torch.empty_like(table) if table is not None else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dtable


def _setup_context(ctx, inputs, output):
    q, k, v, table, q_offsets, k_offsets, max_q_len, max_k_len, max_distance, causal, scale, window, mx_p = inputs
    out, lse, mrow = output
    ctx.save_for_backward(q, k, v, out, lse, mrow, table, q_offsets, k_offsets)
    ctx.args = (max_q_len, max_k_len, max_distance, causal, scale, window, mx_p)


def _backward_rule(ctx, do, _dlse, _dmrow):
    q, k, v, out, lse, mrow, table, q_offsets, k_offsets = ctx.saved_tensors
    dq, dk, dv, dtable = _jagged_attention_bwd_op(do.contiguous(), q, k, v, out, lse, mrow, table, q_offsets, k_offsets,
                                                  *ctx.args)
    return dq, dk, dv, (dtable if table is not None else None), None, None, None, None, None, None, None, None, None


torch.library.register_autograd("gemctl::jagged_attention_fwd", _backward_rule, setup_context=_setup_context)


class _JaggedAttentionEager(torch.autograd.Function):
    """The custom ops' forward and backward for eager mode, without the custom-op wrapper's host
    cost (~400 us a call on the H200 machine, torch 2.11; scripts/host_overhead.py)."""

    @staticmethod
    def forward(ctx, q, k, v, table, q_offsets, k_offsets, max_q_len, max_k_len, max_distance, causal, scale, window,
                mx_p):
        bias = None if table is None else RelativePositionBias(table, max_distance)
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        out, lse, mrow = _forward(q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, bias, causal, scale, window,
                                  mx_p)
        ctx.save_for_backward(q, k, v, out, lse, mrow, table, q_offsets, k_offsets)
        ctx.args = (max_q_len, max_k_len, max_distance, causal, scale, window, mx_p)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, mrow, table, q_offsets, k_offsets = ctx.saved_tensors
        max_q_len, max_k_len, max_distance, causal, scale, window, mx_p = ctx.args
        bias = None if table is None else RelativePositionBias(table, max_distance)
        dq, dk, dv, dtable = _backward(
            do.contiguous(), q, k, v, out, lse, q_offsets, k_offsets, max_q_len, max_k_len, bias, causal, scale, window,
            mrow, mx_p,
        )
        return dq, dk, dv, dtable, None, None, None, None, None, None, None, None, None


def jagged_attention_triton(
    q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, *, bias=None, causal=False, scale=None, window=None, mx_p=0
):
    """Triton implementation of :func:`gemctl.ops.jagged_attention` (same signature, minus backend).
    ``mx_p`` (see :func:`mx_p_code`): the probabilities MX-quantized before the PV product, in
    blocks of 32 keys relative to each row's integer log2 maximum (the reference's numerics); q, k
    and v arrive already quantized (gemctl.ops does that), 0: none."""
    dim = q.shape[-1]
    if dim not in (16, 32, 64, 128, 256):
        raise ValueError(f"jagged_attention (triton): head_dim must be one of 16, 32, 64, 128, 256; got {dim}")
    scale = dim**-0.5 if scale is None else float(scale)
    table = None if bias is None else bias.table
    max_distance = 0 if bias is None else int(bias.max_distance)
    if window is not None and int(window) < 1:
        raise ValueError(f"jagged_attention (triton): window must be None or an int >= 1, got {window!r}")
    window = 0 if window is None else int(window)  # 0: no window (the custom ops take a plain int)
    args = (q, k, v, table, q_offsets, k_offsets, int(max_q_len), int(max_k_len), max_distance, bool(causal), scale,
            window, int(mx_p))
    if torch.compiler.is_compiling():  # traced as a custom op: no graph break
        return _jagged_attention_fwd_op(*args)[0]
    return _JaggedAttentionEager.apply(*args)
