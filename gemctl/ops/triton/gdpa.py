"""GDPA in Triton: out_i = sum_j act(scale * q_i . k_j) v_j over the valid keys of the sequence.

No softmax and no normalization (callers scale). One kernel family covers the three GEM shapes:
PMA (a few queries per sample over jagged K/V), cross-attention (jagged Q over a few K/V tokens per
sample) and self-attention (jagged Q = K/V); the per-sample counts live in the offsets.
Supported: q [Nq, H, D], k/v [Nk, H, D], int64 offsets [B+1], D in {16, 32, 64, 128, 256},
fp16/bf16 on CUDA, fp32 everywhere (CPU tier under TRITON_INTERPRET=1).

Activations: GELU as a polynomial in FMAs only (no erf/exp on the special-function unit; error
bounds below), SiLU; the activation's derivative is fused into the backward.

No masks at all: rows and keys outside a sequence are loaded as zeros, and act(0) = 0 for both
activations, so a padded key contributes act(0) * 0 = 0 to the output and (do . 0) * act'(0) = 0
to the gradients; out-of-range rows are never stored.

Scheduling: host-built lists of valid (sequence, tile) pairs sorted most expensive first
(ops/triton/common.py, from the offsets' host copy: no device sync, cached per batch layout); the
(tile, head) items are either one program each or dealt in zigzag order to a persistent grid of a
few programs per SM; the autotuner picks tiles, warps, stages and the grid per length bucket.
Backward: dK/dV per key tile over the query tiles, dQ per query tile over the key tiles; no
atomics, no zero fills, bitwise reproducible.

On Hopper the forward's candidates also hold the Gluon kernel of gdpa_hopper.py (key sides up to
128 kept in shared memory, TMA query ring, asynchronous wgmma): cross-128's forward 85 us against
127 us for the best config here (H200, 2026-12-03). Autotuning picks between the two families.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from gemctl.ops.triton.common import (
    bucket_len, config_field, gluon_module, gluon_runs, gpu_checked, key_work, load_rows, num_programs, pick_config,
    query_records, query_work, row_descriptors, rows_viewable, store_rows, work_item, zigzag_item,
)

ACTIVATIONS = {"gelu": 0, "silu": 1}
# Configs: (block_m, block_n, warps, stages, programs per SM (0 = one program per item), chunk).
# chunk = 0: the item's own tile stays in registers and the loop runs over the other side's tiles.
# chunk >= 1 ("resident"): the short side - all keys of a sequence in the forward and dQ passes
# (cross-attention), all queries in the dK/dV pass (PMA) - is loaded once into one tile and the
# loop runs over up to `chunk` tiles of the long side, so the pipeliner prefetches the long side's
# tiles. Valid only where the short side fits its tile; the host offers it only then.
# Dropped after the H200's every-candidate run (2026-11-30): dK/dV (32, 128, 8, 3, 0, 4) and dQ
# (128, 32, 8, 3, 0, 4) need 240 KiB of shared memory at D=128 (the limit is 227 KiB).
# Forward configs may carry a seventh field, TMA = 1 (tile-loop configs, chunk 0): the whole key
# tiles by tensor descriptors, as the jagged attention forward does (there the 64x32 tile with TMA
# measured 17-25% faster than without on the H200). They passed the H200's every-candidate test
# (2026-11-30) but did not win there (cross-128: 125.0 vs 123.8 us for 64x32, docs/benchmarks.md),
# so they stay pinned-only. On self-1000 (H200, 2026-12-04) the 64x32 one measured 339.4 us
# against 349.9 us without TMA in one run and 344.3 against 327.4 us in the next: no consistent win.
# An eighth field caps the registers per thread (maxnreg; the seventh, TMA, then 0). The H200's
# profile of cross-128 (2026-11-30, docs/benchmarks.md) has the 64x32 forward at 153 registers,
# three 4-warp programs per SM, the issue slots 56% idle and DRAM at 40%: latency-bound with too
# few warps. Capped at 128 (sm_90 ptxas, Triton 3.6, D=128, GELU: no spills) with 2 stages (48 KB
# of shared memory) four programs fit an SM; the 128x32 / 8-warp tile at 128 registers fits two
# (16 warps either way). Both passed the H200's every-candidate test (2026-11-30, tree 07a9d17).
# cross-128 forward, same run (CUDA-graph time, tree dbc4e0c): capped 64x32 / 2 stages 120.9 us
# (49.4% of the roofline) against 123.2 us for the autotuned 64x32 / 3 stages: 2%, about the
# run-to-run spread, so four programs per SM do not lift the latency bound; it joins autotuning
# (_GPU_CHECKED), the capped 128x32 (135.9 us) stays pinned-only. The 32x32 tiles (96-102
# registers, 26-43 KB: five programs per SM) need no cap; they measured 175.7-195.6 us there.
_FWD_CANDIDATES = [
    (64, 32, 4, 3, 0, 0), (64, 64, 4, 3, 0, 0), (128, 32, 4, 3, 0, 0), (32, 64, 4, 3, 0, 0),
    (32, 32, 4, 3, 0, 0), (32, 32, 4, 2, 0, 0),
    (64, 32, 4, 4, 0, 0), (64, 32, 8, 3, 0, 0), (64, 64, 4, 3, 2, 0), (32, 64, 4, 3, 4, 0),
    (128, 32, 8, 3, 0, 0), (64, 32, 8, 4, 0, 0),
    (64, 32, 4, 3, 0, 4), (64, 32, 4, 4, 0, 4), (64, 32, 4, 3, 0, 8), (32, 32, 2, 3, 0, 8), (64, 32, 4, 2, 0, 4),
    (128, 32, 8, 4, 0, 4), (128, 32, 8, 3, 0, 4), (64, 64, 4, 3, 0, 4),
    (64, 128, 4, 3, 0, 4), (128, 128, 8, 3, 0, 2), (64, 256, 8, 2, 0, 2), (64, 32, 4, 3, 2, 4),
    (64, 32, 4, 3, 0, 0, 1), (64, 64, 4, 3, 0, 0, 1), (128, 32, 8, 3, 0, 0, 1), (64, 32, 4, 3, 2, 0, 1),
    (64, 32, 4, 2, 0, 0, 0, 128), (128, 32, 8, 2, 0, 0, 0, 128),
]
# Tried on self-1000 and dropped (H200, 2026-12-04, one run, passed the every-candidate test): TMA
# with a register cap (sm_90 ptxas, Triton 3.6, D=128, GELU, as a launch specializes it: the 64x32 /
# 3 stages at 176 registers fits two programs per SM, capped at 168 three; 16-key tiles 136
# registers, capped at 128 four; no spills): 332.9 us (64x32 capped at 168), 361.1 / 344.1 / 339.0
# us (64x16 / capped / capped with 4 stages), against 327.4 us for the 64x32 tile loop without TMA
# and 344.3 us with it. More programs per SM do not lift the forward there.
# The resident 128-key forward (64, 128, 4, 3, 0, 4), cross-128's K and V in shared memory once per
# item, measured 181 us (and 128 x 128 / 8 warps 152 us) against 123 us for the 64x32 tile loop
# (H200, 2026-11-29, docs/runs/2026-11-29_bench_gdpa_06dc2d4.json): 123 KB of shared memory leave
# one 4-warp program per SM, whose activation and MMAs run in sequence. With 2 stages
# it takes 106 KB (4 warps, 176 registers) or 115 KB (8 warps, 126 registers): two programs per SM
# (sm_90 ptxas, Triton 3.6), so one's activation could overlap the other's MMAs. Tried and dropped
# (H200, 2026-11-30, tree 5d33fd3; both passed the every-candidate test): cross-128 forward 45.8%
# (4 warps) and 40.6% (8 warps) of the roofline against 49.6% for the capped 64x32 tile loop.
# Hopper configs (ninth field 1): the Gluon resident-key forward (gdpa_hopper.py), for key sides that
# fit one tile. Fields: (block_m = 16 x warps, block_n (>= every key length), warps, query-ring
# stages, programs per SM, query tiles per item (chunk), 0, 0, 1, look-ahead (1: the next item's
# K and V loads start during this item's last tile)).
_HOPPER_FWD_CANDIDATES = [
    (64, 128, 4, 2, 2, 16, 0, 0, 1, 1), (64, 128, 4, 2, 2, 16, 0, 0, 1, 0), (64, 128, 4, 2, 2, 8, 0, 0, 1, 1),
    (64, 64, 4, 2, 2, 16, 0, 0, 1, 1), (64, 32, 4, 3, 2, 16, 0, 0, 1, 1),
    (64, 32, 4, 2, 3, 16, 0, 0, 1, 1), (64, 32, 4, 2, 3, 8, 0, 0, 1, 0),
]
# Measured and removed (H200, 2026-12-04, docs/benchmarks.md): the resident form storing its output
# from registers with a third query slot (cross-128 119 us against 85 us), and a streaming Gluon
# form for long key sides (3% slower than the tile loop on self-1000, and it hung the GPU on the
# every-candidate test's shapes). Also measured and removed (2026-12-05, docs/benchmarks.md): the
# work list dealt to the persistent programs by load instead of zigzag (cross-128, H200: 70.7 against
# 70.5% of the roofline, within noise, though the most loaded program's share fell from 1.12x to
# 1.06x of the mean), and each tile's keys in two halves so that one half's activation runs under
# the other's MMAs (H100: 82.7 against 82.5% for the resident form, 81.2 against 83.8% for the
# warp-specialized one; the math probe alone 294 against 308 TF/s). Both passed their GPU tier.
# And the rows past an item's keys zeroed in K and V in shared memory once per item instead of a
# select on every score (718 instead of 793 sm_90 instructions between a tile's MMAs): its GPU tier
# passed (5 tests), but on cross-128 (H100, 2026-12-05, tree 688d682) it ran 100.3 against 100.7 us
# and its math probe alone 297 against 311 TF/s: fewer instructions, no faster.
# The warp-specialized Gluon forward (ninth field 2; gdpa_hopper._gdpa_fwd_ws): one program per SM
# of a loader warp and two consumer warpgroups sharing each item's K and V. Fields as above, but
# the tenth is the number of K/V buffers (2: the next item's K and V load during this item). Built
# because cross-128 stays at 70% of its roofline with the resident form (85 us against the 74.7 us
# the bar needs). sm_90 ptxas, Triton 3.6: 168 registers at launch (232 a consumer, 40 the loader),
# no spills; 229,704 B of shared memory at 4 query slots and 2 K/V buffers (128 keys, D = 128).
# Pinned-only until the GPU tier passes them (test_gdpa_hopper_forward_gpu).
_HOPPER_WS_CANDIDATES = [
    (64, 128, 4, 4, 1, 16, 0, 0, 2, 2), (64, 128, 4, 6, 1, 16, 0, 0, 2, 1), (64, 128, 4, 4, 1, 8, 0, 0, 2, 2),
    (64, 64, 4, 6, 1, 16, 0, 0, 2, 2), (64, 32, 4, 8, 1, 16, 0, 0, 2, 2),
]
# The streaming warp-specialized forward (ninth field 3; gdpa_hopper._gdpa_fwd_ws_stream), for key
# sides of any length: an item is a pair of 64-row query tiles, one per consumer, and the keys
# stream through a ring of (K, V) tiles (fourth field: its stages) that both consumers read. Built
# (2026-12-04) to widen self-1000's thin margin over the softmax forward (333-340 us against
# 336-340 us); pinned-only until the GPU tier passes it.
_HOPPER_STREAM_CANDIDATES = [
    (64, 64, 4, 4, 1, 0, 0, 0, 3), (64, 64, 4, 3, 1, 0, 0, 0, 3), (64, 128, 4, 2, 1, 0, 0, 0, 3),
    (64, 32, 4, 6, 1, 0, 0, 0, 3),
]
# Measured and removed (2026-12-05, docs/benchmarks.md): the warp-specialized resident forward with
# its consumers taking turns at the tensor cores in the stream's tile order (a twelfth field 1,
# FlashAttention 3's ping-pong), built because the resident form's schedulers idled two cycles in
# three on cross-128. It passed its GPU tier (5 tests) but ran 85.9 against 84.2 us for the same
# config without turns on cross-128 (H200, 69.1 against 70.6% of the roofline) and 98.8 against
# 98.2 us on the H100.
# Also measured and removed (2026-12-06, H100, its math probe): each consumer issuing its next tile's
# S MMA right behind this tile's O MMA (waiting for O alone before the store): the math path alone
# 4-6% slower at cross-128 (312 against 324-333 TF/s), the whole forward level
# (docs/runs/2026-12-06_gdpa_ws_next_s_behind_o.patch).
_FWD_CANDIDATES += _HOPPER_FWD_CANDIDATES + _HOPPER_WS_CANDIDATES + _HOPPER_STREAM_CANDIDATES
# configs with optional fields the GPU tier has passed; the Hopper ones: test_gdpa_hopper_forward_gpu,
# 28 passed (H200, 2026-12-03: 320 items over 2-3 programs per SM, bf16 D=128 and fp16 D=64, GELU and SiLU)
# The warp-specialized winners join them after their GPU tier (H100, 2026-12-05, tree 1fae7ed:
# test_gdpa_hopper_forward_gpu, test_gdpa_hopper_stream_forward_gpu and the every-candidate test over
# all 9 warp-specialized configs, 77 passed): cross-128 99.7 us (ws, 4 query slots, 2 K/V buffers)
# against 100.2 us for the resident pick; self-1000 300.3 / 300.5 us (streaming, 64-key tiles, 4 / 3
# stages) against 335.3 us for the 64x32 tile loop and 344.1 us for the softmax jagged forward.
_GPU_CHECKED: set = {(64, 32, 4, 2, 0, 0, 0, 128), *_HOPPER_FWD_CANDIDATES, (64, 128, 4, 4, 1, 16, 0, 0, 2, 2),
                     (64, 64, 4, 4, 1, 0, 0, 0, 3), (64, 64, 4, 3, 1, 0, 0, 0, 3)}
_PENDING_AUTOTUNE = False  # True: autotuning times every candidate (benchmarks of unchecked ones)
_DKDV_CANDIDATES = [
    (64, 64, 4, 2, 0, 0), (32, 64, 4, 3, 0, 0), (64, 32, 4, 3, 0, 0), (32, 128, 4, 3, 0, 0),
    (64, 64, 4, 2, 2, 0), (32, 64, 4, 3, 4, 0),
    (32, 64, 4, 3, 0, 4), (32, 64, 4, 3, 0, 8), (64, 64, 4, 3, 0, 4),
    (128, 64, 8, 2, 0, 2), (32, 64, 4, 3, 2, 4),
]
_DQ_CANDIDATES = [
    (64, 64, 4, 2, 0, 0), (128, 32, 4, 3, 0, 0), (64, 32, 4, 3, 0, 0), (32, 64, 4, 3, 0, 0),
    (64, 64, 4, 2, 2, 0), (32, 64, 4, 3, 4, 0),
    (64, 32, 4, 3, 0, 4), (64, 32, 4, 3, 0, 8), (64, 64, 4, 3, 0, 4),
    (64, 128, 4, 3, 0, 4), (64, 256, 8, 2, 0, 2), (64, 32, 4, 3, 2, 4),
]
_INTERPRET_CONFIG = (16, 16, 1, 1, 1, 0)  # persistent, so the CPU tier exercises the dealing

# Polynomial GELU (scripts/fit_gelu_poly.py derives the coefficients; tests/test_gdpa_triton.py
# checks the bounds). With t = min(x^2, 16):
#   gelu(x)  ~ 0.5 * (x + t * P(t)) for |x| < 4, relu(x) beyond: max abs error 1.9e-4 (< 2^-12)
#   gelu'(x) ~ 0.5 + x * S(t)       for |x| < 4, step(x) beyond: max abs error 6.6e-4 (< 2^-10)
# over all x, in float32. The kernel rounds the activation to bf16 (relative error up to 2^-9)
# before the second GEMM, so the polynomial's error is below that rounding wherever |gelu| >= 1/8.
# Only FMAs: no erf/exp on the special-function unit.
GELU_CLAMP = 4.0
GELU_P = (7.957667112e-01, -1.291462034e-01, 1.754476875e-02, -1.628029277e-03, 9.591085836e-05,
          -3.197195383e-06, 4.556269317e-08)
GELU_S = (7.977215052e-01, -2.644878030e-01, 5.764032900e-02, -8.216916583e-03, 7.705404423e-04,
          -4.537904897e-05, 1.506969738e-06, -2.137534771e-08)
_C2 = tl.constexpr(GELU_CLAMP * GELU_CLAMP)
_P0, _P1, _P2, _P3, _P4, _P5, _P6 = (tl.constexpr(c) for c in GELU_P)
_S0, _S1, _S2, _S3, _S4, _S5, _S6, _S7 = (tl.constexpr(c) for c in GELU_S)


def gelu_poly_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' polynomial GELU and its derivative in PyTorch, in x's dtype (same Horner
    order): for the bounds test, the fit script and references that isolate kernel arithmetic."""
    t = torch.clamp(x * x, max=GELU_CLAMP**2)
    p, q = torch.full_like(t, GELU_P[-1]), torch.full_like(t, GELU_S[-1])
    for c in GELU_P[-2::-1]:
        p = p * t + c
    for c in GELU_S[-2::-1]:
        q = q * t + c
    inside = t < GELU_CLAMP**2
    value = torch.where(inside, 0.5 * (x + p * t), torch.relu(x))
    grad = torch.where(inside, 0.5 + q * x, (x > 0).to(x.dtype))
    return value, grad


# The kernels' activation on the raw scores a = q . k (x = c a, c = scale), in fewer operations
# per score than act(c a) in the clamped form above: GELU 10 on the H200's FP32 pipe in the forward
# (13 for the clamped form after the scale multiply: sm_90 SASS, Triton 3.6). With u = a^2 and
# t P(t) ~ x erf(x / sqrt 2) (t = x^2),
#   2 gelu(x) / c = a + a erf(x / sqrt 2) ~ a + min(u R(u), |a|),  R_k = c^(2k+1) P_k.
# The min replaces the clamp and select: t P(t) >= |x| for every t >= 16 (its least excess,
# 1.1e-4, at t = 16; degree 7 with a positive leading coefficient grows from there, to inf in fp32),
# so beyond |x| = 4 it gives 2 relu(x) / c = a + |a|, and where it cuts t P(t) below 4 it moves the
# value towards the exact x erf(x / sqrt 2) <= |x|. The kernel accumulates these (2 / c) gelu terms
# and multiplies each output tile by c / 2 once (the backward its dV tiles); the backward's
# derivative folds c the same way (_bwd_act). FOLD = 0 (SiLU, fp16 (fold_scale), or a scale
# outside [2^-6, 2^8]: negative, or small enough that the last coefficient, S_7 c^15, is no normal
# fp32 number: at c = 2^-8 it keeps ~3 bits and the derivative near |x| = 4 was off by 0.95)
# multiplies a by c first and folds nothing (c = 1). _act_consts builds the constants once per
# program; the host decides FOLD once per call (fold_scale).
FOLD_SCALE_RANGE = (2.0**-6, 2.0**8)


def fold_scale(act: int, scale: float, dtype: torch.dtype | None = None) -> bool:
    """Whether the kernels' activation takes the scale into its constants (_fwd_act's FOLD). Not
    for fp16 tensors: the second GEMM's operand is (2 / c) gelu(x) ~ 2x / c, which fp16 (largest
    65504) would overflow from x > 32752 c (x > 2895 at c = 128^-0.5) instead of x > 32752; bf16
    and fp32 have the range."""
    if dtype == torch.float16:
        return False
    return act == 0 and FOLD_SCALE_RANGE[0] <= scale <= FOLD_SCALE_RANGE[1]  # 2 relu(x) / c = a + |a| needs c > 0


def gelu_folded_reference(a: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' GELU on raw scores a (_fwd_act, _bwd_act) in PyTorch, in a's dtype with the same
    constants and Horner order, output factor applied: (gelu(scale * a), gelu'(scale * a)) as the
    kernels compute them."""
    fold = fold_scale(0, scale)
    c = scale if fold else 1.0
    a = a if fold else a * scale
    u = a * a

    def horner(coefs):
        out = torch.full_like(u, coefs[-1])
        for coef in coefs[-2::-1]:
            out = out * u + coef
        return out

    r = horner([p * c ** (2 * k + 1) for k, p in enumerate(GELU_P)])
    g = horner([q * c ** (2 * k + 1) for k, q in enumerate(GELU_S)])
    value = (a + torch.minimum(u * r, a.abs())) * (0.5 * c)
    grad = torch.where(u < GELU_CLAMP**2 / (c * c), 0.5 + a * g, (a > 0).to(a.dtype))
    return value, grad


@triton.jit
def _act_consts(scale, FOLD: tl.constexpr):
    """(pre-multiplier of a, output factor, R_0 .. R_6, bound on u, G_0 .. G_7) of _fwd_act and
    _bwd_act: G_k = c^(2k+1) S_k folds the scale into the derivative's polynomial as R_k into the
    value's (x S(t) = a G(u)), and u < 16 / c^2 is |x| < 4."""
    if FOLD:
        pre = 1.0
        c = scale
    else:
        pre = scale
        c = 1.0
    c2 = c * c
    c3 = c * c2
    c5 = c3 * c2
    c7 = c5 * c2
    c9 = c7 * c2
    c11 = c9 * c2
    c13 = c11 * c2
    return (pre, 0.5 * c, _P0 * c, _P1 * c3, _P2 * c5, _P3 * c7, _P4 * c9, _P5 * c11, _P6 * c13, _C2 / c2,
            _S0 * c, _S1 * c3, _S2 * c5, _S3 * c7, _S4 * c9, _S5 * c11, _S6 * c13, _S7 * (c13 * c2))


@triton.jit
def _fwd_act(a, ac, ACT: tl.constexpr, FOLD: tl.constexpr):
    """act(c a) / ac[1] (GELU) or act(c a) (SiLU) for _act_consts' tuple ac."""
    if not FOLD:
        a = a * ac[0]
    if ACT == 0:
        u = a * a
        r = (((((ac[8] * u + ac[7]) * u + ac[6]) * u + ac[5]) * u + ac[4]) * u + ac[3]) * u + ac[2]
        return a + tl.minimum(u * r, tl.abs(a))
    else:  # SiLU: x * sigmoid(x)
        return a * tl.sigmoid(a)


@triton.jit
def _bwd_act(a, ac, ACT: tl.constexpr, FOLD: tl.constexpr):
    """The backward's recomputed activation on raw scores: (_fwd_act's value, act'(c a)). GELU's
    derivative 0.5 + x S(t) as a G(u) for u < ac[9], the step beyond (no clamp: a u that overflows
    G lies beyond the bound, where the select takes the other side)."""
    if not FOLD:
        a = a * ac[0]
    value = _fwd_act(a, ac, ACT, True)  # a is the folded score now
    if ACT == 0:
        u = a * a
        g = ((((((ac[17] * u + ac[16]) * u + ac[15]) * u + ac[14]) * u + ac[13]) * u + ac[12]) * u
             + ac[11]) * u + ac[10]
        return value, tl.where(u < ac[9], 0.5 + a * g, tl.where(a > 0, 1.0, 0.0))
    else:  # SiLU'(x) = sigmoid(x) * (1 + x * (1 - sigmoid(x)))
        sig = tl.sigmoid(a)
        return value, sig * (1.0 + a * (1.0 - sig))


@triton.jit
def _fwd_out(acc, ac, ACT: tl.constexpr):
    """The output tile from _fwd_act's accumulated terms."""
    if ACT == 0:
        return acc * ac[1]
    else:
        return acc


# Every kernel walks items e = (work index) * heads + head of a host-sorted work list: program pid
# takes items zigzag_item(r, pid, G) for rounds r = 0, 1, ... (G = grid size). G = number of items
# is the plain one-program-per-tile launch; G = a few programs per SM is the persistent grid.


@triton.jit(do_not_specialize=["n_items"])  # per-batch sizes: common.py, "Specialization"
def _gdpa_fwd(
    Q, K, V, O, Q_OFFSETS, K_OFFSETS, WORK, K_DESC, V_DESC, n_items, num_heads,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh, scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACT: tl.constexpr,
    CHUNK: tl.constexpr, TMA: tl.constexpr = False, FOLD: tl.constexpr = False,
):
    # WORK: int32 [n_work, 2] = (sequence, query tile of BLOCK_M * max(CHUNK, 1) rows), one head
    # per item. The activation works on raw scores (_fwd_act, FOLD: the scale in its constants).
    # CHUNK = 0: loop over key tiles. CHUNK >= 1: the keys (<= BLOCK_N) stay resident and the loop
    # runs over the item's query tiles. TMA (CHUNK = 0 only): the whole key tiles come
    # through K_DESC / V_DESC ((BLOCK_N, D) blocks over [Nk, H * D]), the partial last one by masked
    # loads, so no key of another sequence enters a tile.
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    offs_d = tl.arange(0, HEAD_DIM)
    ac = _act_consts(scale, FOLD)
    for r in range(0, tl.cdiv(n_items, n_programs)):
        e = zigzag_item(r, pid, n_programs)
        if e < n_items:
            h = e % num_heads
            if CHUNK == 0:
                m0, q_start, q_len, k_start, k_len, _ = work_item(WORK, Q_OFFSETS, K_OFFSETS, e // num_heads, BLOCK_M)
                offs_m = m0 + tl.arange(0, BLOCK_M)
                q = load_rows(Q, q_start, offs_m, q_len, stride_qn, h * stride_qh, offs_d)
                acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
                whole = 0
                if TMA:
                    whole = k_len // BLOCK_N * BLOCK_N
                    for start_n in range(0, whole, BLOCK_N):
                        # column h * HEAD_DIM: heads adjacent in a row (the host builds the
                        # descriptors only where stride(1) == D)
                        k = K_DESC.load([k_start + start_n, h * HEAD_DIM])  # (BN, D)
                        v = V_DESC.load([k_start + start_n, h * HEAD_DIM])
                        a = _fwd_act(tl.dot(q, tl.trans(k)), ac, ACT, FOLD)
                        acc += tl.dot(a.to(v.dtype), v)
                for start_n in range(whole, k_len, BLOCK_N):
                    cols = start_n + tl.arange(0, BLOCK_N)
                    kt = _load_cols(K, k_start, cols, k_len, stride_kn, h * stride_kh, offs_d)
                    v = load_rows(V, k_start, cols, k_len, stride_vn, h * stride_vh, offs_d)  # (BN, D)
                    a = _fwd_act(tl.dot(q, kt), ac, ACT, FOLD)  # padded keys: s = 0 -> act = 0
                    acc += tl.dot(a.to(v.dtype), v)
                store_rows(O, _fwd_out(acc, ac, ACT), q_start, offs_m, q_len, stride_on, h * stride_oh, offs_d)
            else:
                m0, q_start, q_len, k_start, k_len, _ = work_item(
                    WORK, Q_OFFSETS, K_OFFSETS, e // num_heads, BLOCK_M * CHUNK
                )
                cols = tl.arange(0, BLOCK_N)
                kt = _load_cols(K, k_start, cols, k_len, stride_kn, h * stride_kh, offs_d)
                v = load_rows(V, k_start, cols, k_len, stride_vn, h * stride_vh, offs_d)
                for start_m in range(m0, tl.minimum(m0 + BLOCK_M * CHUNK, q_len), BLOCK_M):
                    offs_m = start_m + tl.arange(0, BLOCK_M)
                    q = load_rows(Q, q_start, offs_m, q_len, stride_qn, h * stride_qh, offs_d)
                    a = _fwd_act(tl.dot(q, kt), ac, ACT, FOLD)
                    store_rows(O, _fwd_out(tl.dot(a.to(v.dtype), v), ac, ACT), q_start, offs_m, q_len, stride_on, h * stride_oh, offs_d)


@triton.jit
def _load_cols(PTR, start, cols, length, stride_n, head_offset, offs_d):
    """A (D, cols) tile: rows ``cols`` of a jagged [N, H, D] tensor, transposed (K^T for Q K^T)."""
    ptrs = PTR + (start + cols)[None, :] * stride_n + head_offset + offs_d[:, None]
    return tl.load(ptrs, mask=(cols < length)[None, :], other=0.0)


@triton.jit(do_not_specialize=["n_items"])  # per-batch sizes: common.py, "Specialization"
def _gdpa_bwd_dkdv(
    Q, K, V, DO, DK, DV, Q_OFFSETS, K_OFFSETS, WORK, n_items, num_heads,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_don, stride_doh, stride_dkn, stride_dkh, stride_dvn, stride_dvh, scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACT: tl.constexpr,
    CHUNK: tl.constexpr, FOLD: tl.constexpr = False,
):
    # WORK: (sequence, key tile of BLOCK_N * max(CHUNK, 1) rows), one head per item; an item with
    # no queries writes the zero gradients of its keys. CHUNK = 0: the keys stay, the loop runs
    # over query tiles. CHUNK >= 1: the queries (<= BLOCK_M) stay, the loop runs over key tiles.
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    offs_d = tl.arange(0, HEAD_DIM)
    ac = _act_consts(scale, FOLD)
    for r in range(0, tl.cdiv(n_items, n_programs)):
        e = zigzag_item(r, pid, n_programs)
        if e < n_items:
            h = e % num_heads
            if CHUNK == 0:
                n0, q_start, q_len, k_start, k_len, _ = work_item(WORK, Q_OFFSETS, K_OFFSETS, e // num_heads, BLOCK_N)
                offs_n = n0 + tl.arange(0, BLOCK_N)
                k = load_rows(K, k_start, offs_n, k_len, stride_kn, h * stride_kh, offs_d)
                v = load_rows(V, k_start, offs_n, k_len, stride_vn, h * stride_vh, offs_d)
                dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
                dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
                for start_m in range(0, q_len, BLOCK_M):
                    offs_m = start_m + tl.arange(0, BLOCK_M)
                    q = load_rows(Q, q_start, offs_m, q_len, stride_qn, h * stride_qh, offs_d)
                    do = load_rows(DO, q_start, offs_m, q_len, stride_don, h * stride_doh, offs_d)
                    a, da = _bwd_act(tl.dot(q, tl.trans(k)), ac, ACT, FOLD)  # (BM, BN)
                    dv += tl.dot(tl.trans(a.to(do.dtype)), do)
                    ds = tl.dot(do, tl.trans(v)) * da
                    dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
                store_rows(DK, dk * scale, k_start, offs_n, k_len, stride_dkn, h * stride_dkh, offs_d)
                store_rows(DV, _fwd_out(dv, ac, ACT), k_start, offs_n, k_len, stride_dvn, h * stride_dvh, offs_d)
            else:
                n0, q_start, q_len, k_start, k_len, _ = work_item(
                    WORK, Q_OFFSETS, K_OFFSETS, e // num_heads, BLOCK_N * CHUNK
                )
                offs_m = tl.arange(0, BLOCK_M)
                q = load_rows(Q, q_start, offs_m, q_len, stride_qn, h * stride_qh, offs_d)
                do = load_rows(DO, q_start, offs_m, q_len, stride_don, h * stride_doh, offs_d)
                qt = tl.trans(q)
                for start_n in range(n0, tl.minimum(n0 + BLOCK_N * CHUNK, k_len), BLOCK_N):
                    offs_n = start_n + tl.arange(0, BLOCK_N)
                    k = load_rows(K, k_start, offs_n, k_len, stride_kn, h * stride_kh, offs_d)
                    v = load_rows(V, k_start, offs_n, k_len, stride_vn, h * stride_vh, offs_d)
                    a, da = _bwd_act(tl.dot(k, qt), ac, ACT, FOLD)  # (BN, BM) = S^T
                    dv = tl.dot(a.to(do.dtype), do)
                    ds = tl.dot(v, tl.trans(do)) * da  # dS^T
                    dk = tl.dot(ds.to(q.dtype), q)
                    store_rows(DK, dk * scale, k_start, offs_n, k_len, stride_dkn, h * stride_dkh, offs_d)
                    store_rows(DV, _fwd_out(dv, ac, ACT), k_start, offs_n, k_len, stride_dvn, h * stride_dvh, offs_d)


@triton.jit(do_not_specialize=["n_items"])  # per-batch sizes: common.py, "Specialization"
def _gdpa_bwd_dq(
    Q, K, V, DO, DQ, Q_OFFSETS, K_OFFSETS, WORK, n_items, num_heads,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_don, stride_doh, stride_dqn, stride_dqh, scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACT: tl.constexpr,
    CHUNK: tl.constexpr, FOLD: tl.constexpr = False,
):
    # WORK: (sequence, query tile of BLOCK_M * max(CHUNK, 1) rows), one head per item. CHUNK = 0:
    # the queries stay, the loop runs over key tiles. CHUNK >= 1: the keys (<= BLOCK_N) stay, the
    # loop runs over the item's query tiles.
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    offs_d = tl.arange(0, HEAD_DIM)
    ac = _act_consts(scale, FOLD)
    for r in range(0, tl.cdiv(n_items, n_programs)):
        e = zigzag_item(r, pid, n_programs)
        if e < n_items:
            h = e % num_heads
            if CHUNK == 0:
                m0, q_start, q_len, k_start, k_len, _ = work_item(WORK, Q_OFFSETS, K_OFFSETS, e // num_heads, BLOCK_M)
                offs_m = m0 + tl.arange(0, BLOCK_M)
                q = load_rows(Q, q_start, offs_m, q_len, stride_qn, h * stride_qh, offs_d)
                do = load_rows(DO, q_start, offs_m, q_len, stride_don, h * stride_doh, offs_d)
                dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
                for start_n in range(0, k_len, BLOCK_N):
                    offs_n = start_n + tl.arange(0, BLOCK_N)
                    k = load_rows(K, k_start, offs_n, k_len, stride_kn, h * stride_kh, offs_d)
                    v = load_rows(V, k_start, offs_n, k_len, stride_vn, h * stride_vh, offs_d)
                    a, da = _bwd_act(tl.dot(q, tl.trans(k)), ac, ACT, FOLD)
                    ds = tl.dot(do, tl.trans(v)) * da
                    dq += tl.dot(ds.to(k.dtype), k)
                store_rows(DQ, dq * scale, q_start, offs_m, q_len, stride_dqn, h * stride_dqh, offs_d)
            else:
                m0, q_start, q_len, k_start, k_len, _ = work_item(
                    WORK, Q_OFFSETS, K_OFFSETS, e // num_heads, BLOCK_M * CHUNK
                )
                cols = tl.arange(0, BLOCK_N)
                k = load_rows(K, k_start, cols, k_len, stride_kn, h * stride_kh, offs_d)
                v = load_rows(V, k_start, cols, k_len, stride_vn, h * stride_vh, offs_d)
                kt, vt = tl.trans(k), tl.trans(v)
                for start_m in range(m0, tl.minimum(m0 + BLOCK_M * CHUNK, q_len), BLOCK_M):
                    offs_m = start_m + tl.arange(0, BLOCK_M)
                    q = load_rows(Q, q_start, offs_m, q_len, stride_qn, h * stride_qh, offs_d)
                    do = load_rows(DO, q_start, offs_m, q_len, stride_don, h * stride_doh, offs_d)
                    a, da = _bwd_act(tl.dot(q, kt), ac, ACT, FOLD)
                    ds = tl.dot(do, vt) * da
                    dq = tl.dot(ds.to(k.dtype), k)
                    store_rows(DQ, dq * scale, q_start, offs_m, q_len, stride_dqn, h * stride_dqh, offs_d)


# ----------------------------------------------------------------------------------------------
# Host side.


def _launch(kernel, work, heads, cfg, args, dim, act, after_work=(), **constexprs):
    """``after_work``: arguments between WORK and n_items (the forward's K/V descriptors)."""
    bm, bn, warps, stages, per_sm, chunk = cfg[:6]
    n_items = work.shape[0] * heads
    if n_items:
        grid = (num_programs(n_items, per_sm, work.device),)
        cap = config_field(cfg, 7)  # registers per thread (maxnreg), 0: the compiler's choice
        kernel[grid](*args[:-1], work, *after_work, n_items, heads, *args[-1], HEAD_DIM=dim, BLOCK_M=bm, BLOCK_N=bn,
                     ACT=act, CHUNK=chunk, num_warps=warps, num_stages=stages, **({"maxnreg": cap} if cap else {}),
                     **constexprs)


def _hopper():
    """gemctl.ops.triton.gdpa_hopper, or ValueError where it cannot run (common.gluon_module): the
    autotuner then skips its configs."""
    return gluon_module("gdpa_hopper", "gdpa")


def _hopper_runs(device: torch.device) -> bool:
    """An sm_90+ GPU and a Triton with Gluon's Hopper API (asked once per device)."""
    return gluon_runs("gdpa_hopper", device)


def _hopper_eligible(q, k, v, out) -> bool:
    """Whether the Hopper configs can all run here: an sm_90+ GPU with Gluon, bf16/fp16, head_dim 64
    or 128, and q/out (k/v) readable by TMA in boxes of 64 (128) rows."""
    return (q.dtype in (torch.bfloat16, torch.float16) and q.shape[2] in (64, 128) and _hopper_runs(q.device)
            and all(rows_viewable(t, 64) for t in (q, out)) and all(rows_viewable(t, 128) for t in (k, v)))


def _candidates(candidates, resident_len: int, resident_block: int):
    """Resident configs (chunk >= 1) only where the short side fits its tile for every length of
    this autotune bucket; resident_block is the index of that tile's size in the config."""
    return [c for c in candidates if c[5] == 0 or bucket_len(resident_len) <= c[resident_block]]


def _check_resident(cfg, length: int, block: int, side: str):
    if cfg[5] and length > cfg[block]:  # only reachable through forced_config
        raise ValueError(f"gdpa: resident config {cfg} needs every {side} length <= {cfg[block]}, got {length}")


def _forward_candidates(hopper: bool, max_k_len: int) -> list:
    """The forward configs autotuning times: the Gluon ones only where ``hopper``; resident ones
    where the keys fit their tile, and then not the streaming Gluon form, which is for key sides
    no resident tile holds (on cross-128 it ran 114 us against 100 us for the resident forms, H100,
    2026-12-05: timing it there only costs tuning time). The rule came first, when autotuning still
    ranked Python calls and picked it there; it now ranks GPU time (common._time)."""
    cands = _FWD_CANDIDATES if hopper else [c for c in _FWD_CANDIDATES if not config_field(c, 8)]
    cands = _candidates(cands, max_k_len, 1)
    if any(c[5] and config_field(c, 8) for c in cands):
        cands = [c for c in cands if config_field(c, 8) != 3]
    return gpu_checked(cands, 6, _GPU_CHECKED, _PENDING_AUTOTUNE)


_output_like = torch.empty_like  # the forward's output buffer (the GPU tier fills it with NaN: a missed store shows)


def item_rows(cfg: tuple) -> int:
    """Query rows per work item of a forward config: block_m x chunk, and for the streaming
    warp-specialized Gluon kernel (ninth field 3) its pair of block_m tiles, one per consumer."""
    if config_field(cfg, 8) == 3:
        return 2 * cfg[0]
    return cfg[0] * max(cfg[5], 1)


def _forward(q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, act, scale):
    heads, dim = q.shape[1], q.shape[2]
    out = _output_like(q)  # every query tile is an item; with no keys it writes zeros
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1), scale)

    fold = fold_scale(act, scale, q.dtype)

    def run(cfg):
        _check_resident(cfg, max_k_len, 1, "key")
        if config_field(cfg, 8):  # the Gluon kernel for Hopper: its items as resolved records
            records = query_records(q_offsets, k_offsets, item_rows(cfg), False, q.device)
            _hopper().forward(q, k, v, out, records, act, scale, cfg, fold=fold)
            return
        work = query_work(q_offsets, k_offsets, item_rows(cfg), False, q.device)
        # TMA field set (tile-loop configs): K/V descriptors, or masked loads where the layout has none
        descs = row_descriptors(cfg[1], k, v) if config_field(cfg, 6) and not cfg[5] else None
        _launch(_gdpa_fwd, work, heads, cfg, (q, k, v, out, q_offsets, k_offsets, strides), dim, act,
                descs or (None, None), TMA=descs is not None, FOLD=fold)

    # Whether every Hopper config can run on these tensors is part of the key: a config tuned on
    # tensors that TMA can read is never handed ones it cannot (a batch with fewer rows than a box).
    hopper = _hopper_eligible(q, k, v, out)
    key = ("gdpa_fwd", dim, q.dtype, act, bucket_len(max_q_len), bucket_len(max_k_len)) + (("hopper",) if hopper else ())

    run(pick_config(key, lambda: _forward_candidates(hopper, max_k_len), run, _INTERPRET_CONFIG))
    return out


def _backward(do, q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, act, scale):
    heads, dim = q.shape[1], q.shape[2]
    do = do if do.stride(-1) == 1 else do.contiguous()
    # No zero fills: every key tile (also of sequences without queries) and every query tile is an
    # item, and each writes its rows.
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1))
    fold = fold_scale(act, scale, q.dtype)

    def run_dkdv(cfg):
        _check_resident(cfg, max_q_len, 0, "query")
        work = key_work(q_offsets, k_offsets, cfg[1] * max(cfg[5], 1), False, q.device, include_empty=True)
        strides = common + (dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), scale)
        _launch(_gdpa_bwd_dkdv, work, heads, cfg, (q, k, v, do, dk, dv, q_offsets, k_offsets, strides), dim, act,
                FOLD=fold)

    def run_dq(cfg):
        _check_resident(cfg, max_k_len, 1, "key")
        work = query_work(q_offsets, k_offsets, item_rows(cfg), False, q.device)
        strides = common + (dq.stride(0), dq.stride(1), scale)
        _launch(_gdpa_bwd_dq, work, heads, cfg, (q, k, v, do, dq, q_offsets, k_offsets, strides), dim, act,
                FOLD=fold)

    key = (dim, q.dtype, act, bucket_len(max_q_len), bucket_len(max_k_len))
    run_dkdv(pick_config(("gdpa_dkdv",) + key, lambda: _candidates(_DKDV_CANDIDATES, max_q_len, 0), run_dkdv,
                         _INTERPRET_CONFIG))
    run_dq(pick_config(("gdpa_dq",) + key, lambda: _candidates(_DQ_CANDIDATES, max_k_len, 1), run_dq, _INTERPRET_CONFIG))
    return dq, dk, dv


@torch.library.custom_op("gemctl::gdpa_fwd", mutates_args=())
def _gdpa_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor, k_offsets: torch.Tensor,
    max_q_len: int, max_k_len: int, act: int, scale: float,
) -> torch.Tensor:
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return _forward(q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, act, scale)


@_gdpa_fwd_op.register_fake
def _(q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, act, scale):
    return torch.empty_like(q)


@torch.library.custom_op("gemctl::gdpa_bwd", mutates_args=())
def _gdpa_bwd_op(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
    k_offsets: torch.Tensor, max_q_len: int, max_k_len: int, act: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return _backward(do, q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, act, scale)


@_gdpa_bwd_op.register_fake
def _(do, q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, act, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, act, scale = inputs
    ctx.save_for_backward(q, k, v, q_offsets, k_offsets)
    ctx.args = (max_q_len, max_k_len, act, scale)


def _backward_rule(ctx, do):
    q, k, v, q_offsets, k_offsets = ctx.saved_tensors
    dq, dk, dv = _gdpa_bwd_op(do, q, k, v, q_offsets, k_offsets, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


torch.library.register_autograd("gemctl::gdpa_fwd", _backward_rule, setup_context=_setup_context)


class _GDPAEager(torch.autograd.Function):
    """The same forward and backward as the custom ops, for eager mode: the custom-op wrapper cost
    ~400 us of host time per call on the H200 machine (scripts/host_overhead.py, torch 2.11),
    several times the GPU time of a PMA or cross-attention call."""

    @staticmethod
    def forward(ctx, q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, act, scale):
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        ctx.save_for_backward(q, k, v, q_offsets, k_offsets)
        ctx.args = (max_q_len, max_k_len, act, scale)
        return _forward(q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, act, scale)

    @staticmethod
    def backward(ctx, do):
        q, k, v, q_offsets, k_offsets = ctx.saved_tensors
        dq, dk, dv = _backward(do, q, k, v, q_offsets, k_offsets, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None


def gdpa_triton(q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, *, activation="gelu", scale=None):
    """Triton implementation of :func:`gemctl.ops.gdpa` (same signature, minus backend)."""
    dim = q.shape[-1]
    if dim not in (16, 32, 64, 128, 256):
        raise ValueError(f"gdpa (triton): head_dim must be one of 16, 32, 64, 128, 256; got {dim}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"gdpa: activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    scale = dim**-0.5 if scale is None else float(scale)
    # torch.compile traces the custom op (no graph break); eager calls skip its wrapper.
    op = _gdpa_fwd_op if torch.compiler.is_compiling() else _GDPAEager.apply
    return op(q, k, v, q_offsets, k_offsets, int(max_q_len), int(max_k_len), ACTIVATIONS[activation], scale)
