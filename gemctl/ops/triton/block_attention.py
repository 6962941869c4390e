"""Block attention in Triton, RoPE fused: softmax attention inside consecutive blocks of each sequence.

Math, per sequence (length L) and block c (rows r in [c*BS, min((c+1)*BS, L)), BS = block_size):
    q~_r, k~_r = rope(q_r, r), rope(k_r, r)        rotation by the position r from the sequence start
    o_r = sum_{j in block c} softmax_j(scale * q~_r . k~_j) v_j      (non-causal, no bias)
rope (rotate-half convention, as gemctl.ops.apply_rope): with x = [x1, x2] split at D/2 and the
tables' rows c = cos[r], s = sin[r], rope(x, r) = [x1 c - x2 s, x2 c + x1 s]. The tables are
``rope=(cos, sin)``, each ``[>= max_len, D // 2]`` (any float dtype, read in fp32; the rotation runs in
fp32 in both passes, or, with _PACKED_ROPE, in bf16x2 in both passes for bf16 on sm_90+), or a
float base frequency b, for which the tables cos/sin(r * b ** (-i / (D/2))) are built in float64,
stored on the device in ``rope_table_dtype(q.dtype)`` (fp16 for 16-bit inputs, fp32 otherwise) and
cached per (base, D, device, dtype), grown to the next power of two of max_len.

Supported: q, k, v [N, H, D] (any row/head strides, contiguous head dim), int64 offsets [B+1],
block sizes 16-128 (GEM uses 64; 32/64/128 are tested), D in {32, 64, 128}, fp16/bf16 on CUDA,
fp32 everywhere (the CPU tier runs under TRITON_INTERPRET=1; fp32 dots use TF32 on the GPU).

Kernels: one program per (sequence, block) work item and group of heads (one head, or all heads
looped inside the program with the rotation tables loaded once). The work list holds only valid
blocks (a sequence of length L gets ceil(L / BS), an empty one none), built on the host from the
offsets' host copy (gemctl.ops.host: no device sync) and cached per batch layout
(common.query_work with a tile of BS rows). The whole block fits one tile, so there is no online
softmax: the forward loads q, k, v once, rotates the q and k tiles in registers (two halves, cos/sin
rows by position, in fp32 as the backward rotates them; the rotated copies never reach HBM), and
writes o and the per-row log2-sum-exp2 (fp32, for the backward).
The backward is one kernel too, per (block, head): it recomputes p = exp2(s - lse), dv = p^T do
(stored at once), dp = do v^T, the softmax backward's row term
delta = rowsum(p * dp) (the whole row is in the tile: equal to rowsum(do * o), without reading o),
ds = p * (dp - delta), dq~ = ds k~, dk~ = ds^T q~, and applies the inverse rotation
(by -theta: [d1 c + d2 s, d2 c - d1 s]) to dq~ and dk~ in the epilogue, each gradient stored before
the next is computed. No atomics, no zero fills
(each row belongs to exactly one block): bitwise reproducible.

Partial last blocks: rows at or beyond L load as 0 and are never stored; keys at or beyond L get a
-inf score (forward) or p = 0 (backward). A block always holds >= 1 valid key, so every stored row
has a finite log-sum-exp.

Bytes that must move (E = element size, T = tokens, H heads, D head dim):
    forward  = 3*T*H*D*E (q, k, v) + T*H*D*E (o) + 4*T*H (lse)
    backward = 4*T*H*D*E (q, k, v, do) + 4*T*H (lse) + 3*T*H*D*E (dq, dk, dv)   (o is not read)
plus the rope tables' rows, read through L2 (max_len * D * 4 bytes of unique data).
Each K/V element serves one block of queries, so the kernels are memory-bound at every block size.

Programs per SM at the tuned picks (sm_90 ptxas of Triton 3.6, compiled as the launch specializes
them; bf16, D = 128, block 64, fp16 rope tables, 4 warps): the forward (4, 2, 0, 0, 1) holds 202
registers and 80 KB of shared memory (two programs per SM); the backward (4, 1, 1, 0, 1) 168
registers and 64 KB (three: both limits at once); without rope the backward needs 128 registers and
56 KB (four). With fp32 tables the backward needs 218 registers (two): why fp16 tables made it 14%
faster. Block 128 with rope: forward 96 KB, backward 129 KB (one program per SM).
TMA: configs with a fourth field 1 load whole blocks through tensor descriptors (see the configs);
HALVES: configs with a fifth field 1 hold v and o (forward), do, v and dv (backward) as (BS, D/2)
halves.
HOPPER: configs with a sixth field (programs per SM) run the forward or the backward as the persistent
Gluon kernels of block_attention_hopper.py (block 64, 16-bit inputs, sm_90+), whose next block loads
while this one computes; they passed the GPU tier. The forward at three programs per SM is autotuned
(the fastest forward on the H200, slower than the Triton one on the H100); so is the backward at two
programs per SM since it stopped spilling (the H100's pick at D=128 with fp16 rope tables,
2026-12-05; without rope or with fp32 tables the autotuner keeps Triton configs there).
Known limits: no warp specialization, no persistent grid in the Triton kernels (Triton 3.x); the
tables get no gradient.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from gemctl.ops import BLOCK_KERNEL_DIMS, BLOCK_KERNEL_SIZES
from gemctl.ops.reference.block import rope_cos_sin, rope_table_dtype
from gemctl.ops.triton.common import (
    INTERPRET, bucket_len, cdiv, config_field, gluon_module, gluon_runs, gpu_checked, load_tile, pick_config,
    query_records, query_work, row_descriptors, store_rows, whole_tile_work, work_item, work_record,
)

LOG2E = 1.4426950408889634

# Configs: (num_warps, num_stages, heads per program; 0 = all heads of the block in one program
# [, TMA [, HALVES]]). One tile per block, so the stage count matters only when a program loops
# over heads (the pipeliner can then prefetch the next head's tiles while this one computes).
# TMA = 1: the tiles of whole blocks come through tensor descriptors over [N, H * D] (q and k as
# two (BS, D/2) halves, v and do as (BS, D), or (BS, D/2) in the half-width forward) in one
# launch; the partial last blocks get a
# second launch with masked loads, so no row of another sequence is ever read. The descriptors'
# loads land in shared memory asynchronously and need no address registers, which is what a
# memory-bound kernel at the register cap lacks (docs/benchmarks.md). Timed on the H200
# (2026-11-30): the forward's best TMA config within 2-5% of its twin either way, every TMA
# backward slower (by 10% at 4 warps), so no TMA config joins autotuning (_FWD_CHECKED,
# _BWD_CHECKED); they stay configs that can be pinned. At block 128 with rope (D=128) the staged
# tiles exceed the 227 KiB of shared memory at 3 stages forward / 2 backward: autotuning skips a
# config that does not compile (pick_config), a pinned one raises.
# HALVES = 1 (forward, fifth field): v and o in (BS, D/2) halves, each half of o stored before the
# next is formed: sm_90 ptxas (Triton 3.6), D=128, block 64 with RoPE, 4 warps, 2 stages: 226
# registers against 253 (the fp32 output accumulator is half as wide), 202 with the bf16x2 rotation.
# H200, 2026-12-01, self-1000 / self-4000 (docs/runs/2026-12-01_sweep_block_*): (4, 2, 0, 0, 1)
# 111.5 / 95.0 us against 116.5 / 99.6 for (4, 2, 0) with the fp32 rotation, 107.2 / 91.8 against
# 110.3 / 94.5 with bf16x2; it passed the GPU tier and joins autotuning. Its TMA twin
# (4, 2, 0, 1, 1) was slower (115.0 / 104.9 us) and stays pinned-only.
# HOPPER (sixth field, programs per SM): the Gluon forward of block_attention_hopper.py, on the plan of
# its backward (below); o staged in v's tiles once o's MMAs have read them. sm_90 ptxas (Triton 3.6),
# D=128, rope with fp16 tables: 136 registers, no spills, 65,560 B: three programs per SM (without
# rope 113 and 49,176 B: four fit, three asked). Passed the GPU tier (H100, 2026-12-05) and measured
# 142.0 / 141.0 us at self-1000 against 135.9 us for (4, 2, 0, 0, 1) (fp32 rotation) on the H100, but
# on the H200 (same day, docs/runs/2026-12-05_sweep_block_*_h200.json) 105.1 / 88.9 us at self-1000 /
# self-4000 (82.3% / 84.4% of the memory roofline) against 111.3 / 95.2 us (77.8% / 78.8%): three
# programs per SM, as it was built for. (4, 1, 1, 0, 0, 3) joins autotuning, which picks per GPU.
_HOPPER_FWD_CANDIDATES = [(4, 1, 1, 0, 0, 3), (4, 1, 1, 0, 0, 2)]
_FWD_CANDIDATES = [(4, 1, 1), (8, 1, 1), (4, 2, 0), (8, 2, 0), (4, 3, 0), (4, 2, 2), (2, 1, 1),
                   (4, 1, 1, 1), (4, 2, 0, 1), (4, 3, 0, 1), (8, 2, 0, 1), (4, 2, 0, 0, 1), (4, 2, 0, 1, 1),
                   *_HOPPER_FWD_CANDIDATES]
# HALVES = 1 (backward, fifth field): do, v and dv in (BS, D/2) halves, so the dv accumulator is
# half as wide; sm_90 ptxas (Triton 3.6), D=128, block 64 with RoPE: spill stores 576 -> 376 B per
# thread at 4 warps, 88 -> 0 at 8 warps (254 registers; figures of the kernel of the time, compiled
# with the tables' row stride unspecialized, which no launch does: see the module docstring for
# today's). H200, 2026-11-30: the GPU tier passed all
# four; (4, 1, 1, 0, 1) ran 2% faster than (4, 1, 1) (321 vs 328 us self-1000, 272 vs 277 us
# self-4000) and joins autotuning; the other three were 25-40% slower and stay pinned-only. Since
# the backward stopped reading o (ad18b2f) the full-width (4, 1, 1) wins again (294.7 vs 307.8 us
# self-1000, H200, 2026-11-30); the half-width config stays a candidate for the shapes it may win.
# With fp16 rope tables (rope_table_dtype of bf16 inputs) the half-width config wins again, by more:
# 231.3 vs 256.2 us self-1000, 195.6 vs 215.6 us self-4000 (H200, 2026-12-01, tree 730ce6a), so the
# tables' dtype is part of the autotune key (_table_key). (4, 1, 0, 0, 1): the half-width body with
# all heads of a block in one program, unpipelined (the rope rows each gradient re-reads then come
# from L1 for the heads after the first; 255 registers and 100 B of spills with the head loop, two
# programs per SM); it passed the GPU tier but ran 19-21% slower than
# (4, 1, 1, 0, 1) (275.4 vs 231.2 us self-1000, H200, 2026-12-01), so it stays pinned-only.
# Tried and dropped (H200, 2026-12-01, docs/runs/2026-12-01_sweep_block_early_v_61f9ad6.json): v
# loaded with do, q and k at the start (one wait on memory per block instead of two) took 177
# registers against the pick's 168, so two programs per SM instead of three, and ran 14% slower
# (264.1 vs 232.2 us self-1000): the pick sits exactly at the three-program limit.
# Also dropped: a half-width backward with every tile of a whole block through tensor descriptors
# (q, k, v, do, the rope rows loaded; dq, dk, dv stored; rotations in bf16x2): 171 registers (two
# programs per SM), 48-52% slower (343-352 vs 231 us self-1000); capped at 168 registers (three,
# 128 B of spills) still 28-33% slower, and with masked stores or the rope rows by pointers not much
# faster (321-344 us). Raw: docs/runs/2026-12-01_sweep_block_tma_bwd_*; the GPU tier passed each.
# Also dropped (H200, 2026-12-01, tree d714d25, diffs in docs/runs/2026-12-01_block_bwd_*.patch):
# two programs per (block, head), one forming dq, the other dk and dv in the transposed form (each
# rotated operand staged once): 40 KB of shared memory but 182 registers, 1.3-3.0x slower at every
# warp count and register cap; v's halves requested together (one wait on memory, not two): no
# change; q and k rotated in bf16x2 (14% fewer SASS instructions): 1-2% slower; the gradients'
# inverse rotation in bf16x2 too: 172 registers, 18% slower; dq's rope rows requested before its
# dots: no change (dk's too: 1-2% slower; kept from dq to dk: 195 registers, 10% slower); the tiles
# of the programs 132 to 792 launches later prefetched into L2: 10-23% slower. docs/benchmarks.md
# has the table and an Nsight Compute profile of the pick.
# HOPPER (sixth field, programs per SM): the Gluon backward of block_attention_hopper.py (block 64,
# bf16/fp16, D 64/128, sm_90+): persistent programs, every tile a (BS, D/2) TMA box, the next
# item's tiles loading while this one's gradients are formed, stored by TMA. First built at 255
# registers and 92 B of spills: the compiler hoisted the MMAs' shared-memory descriptors out of the
# item loop and kept them in ~40 vector registers, and Nsight Compute (H100, 2026-12-05) put about
# a third of the warps' stall samples on long-scoreboard waits at the top of each item, the top ones
# on registers reloaded from local memory (docs/benchmarks.md). It measured
# 286.1 us at self-1000 against 272.6 us for (4, 1, 1, 0, 1) (H100), and 249.2 against 231.8 us on
# the H200. Formed inside the loop (block_attention_hopper, `z`), sm_90 ptxas (Triton 3.6), D=128,
# rope with fp16 tables: 214 registers, no spills, 106,536 B of shared memory: two programs per SM
# (without rope 178 registers, 90,152 B; D=64 156). H100, 2026-12-05, two alternating sweeps
# against the spilling build: 262.5 / 261.3 us at self-1000 (81.4% / 81.8% of the memory roofline)
# against 286.1 / 287.3 us, and 218.3 / 218.5 us at self-4000 (84.8%) against 237.1 / 237.3 us;
# the Triton pick 272.4 / 272.9 and 230.9 / 231.5 us in the same runs. H200 (same day, two sweeps):
# 216.0 / 216.2 us at self-1000 (70.0%) and 177.4 / 180.2 us at self-4000 (73.8% / 72.7%) against
# 233.7 / 233.1 and 197.5 / 198.6 us for the Triton pick. Passed the GPU tier (58 tests:
# test_block_attention_hopper_gpu, the non-finite rows past the sequences, the every-candidate
# test) and joins autotuning; one program per SM stays pinned-only.
# Since 2026-12-06 the same configs run a restructured backward: the next item's q, k, v, do and
# rope rows load as soon as this item's MMAs or stores have read the tiles they land in (two q
# tiles, two that k and v share), and the record of the item after next is loaded one field per
# lane. H200, two alternating sweeps against the build above
# (docs/runs/2026-12-06_sweep_block_bwd_ring_*_h200.json): 196.4 / 196.4 us at self-1000 (77.0%)
# against 215.7 / 217.6 us, 160.0 / 161.0 us at self-4000 (81.9% / 81.4%) against 179.2 / 180.5
# us; the forward 104.4 / 104.3 against 105.4 / 105.5 us. On an H100, where the older build
# already moved 82-84% of the card's copy bandwidth, it is 4.5% slower (272.4 / 273.0 against
# 260.1 / 261.4 us at self-1000, ..._h100.json): the H200 has 1.41x the bandwidth for the same
# SMs, and there the waits on each item's loads are what the restructure removes. GPU tier on the
# H200: 95 passed (docs/runs/2026-12-06_gpu_tests_block_bwd_ring_h200.log). Then the next item's
# do loads before dq's MMAs and its v while dk's run (they waited for dq's and dk's stores): H100,
# two alternating sweeps, 268.3 / 268.1 against 273.1 / 273.1 us at self-1000, 218.8 / 219.4
# against 224.3 / 224.2 us at self-4000 (docs/runs/2026-12-06_sweep_block_bwd_early_*_h100.json).
# PAIR (ninth field 1): the Gluon backward runs each block of at most 32 rows as one item per two
# heads (one head's rows in each half of every tile; block_attention_hopper.paired_records), 4.1% fewer
# items at self-1000. The backward's time follows its item count (a whole-block batch with 9.1% more
# tokens and the same items takes as long), and the same count without such a kernel
# (bench_block_attention.py --trimmed-tails) took 3.0-3.2% less time on the H200, 80.6-81.2% of
# self-1000's roofline (docs/benchmarks.md). GPU tier on an H100, 2026-12-06: 22 passed. Two H100
# sweeps: 261.4 / 260.4 us at self-1000 against 263.0 / 262.3 us unpaired, 219.9 / 219.6 us at
# self-4000 against 217.3 / 216.8 us: a pair costs more than a single item, and autotuning's key
# does not tell the two length mixes apart. H200, two sweeps (2026-12-06): 192.9 / 193.3 us at
# self-1000 against 193.9 / 194.3 us (0.5% less), 164.7 / 165.6 us at self-4000 against 161.6 /
# 161.1 us (2-3% more). Left out of autotuning (_BWD_CHECKED); docs/runs/2026-12-06_block_pair_autotuned.patch
# puts it in.
_HOPPER_BWD_CANDIDATES = [(4, 1, 1, 0, 0, 2), (4, 1, 1, 0, 0, 1), (4, 1, 1, 0, 0, 2, 0, 0, 1)]
# RECORDS (seventh field): the picks reading their block from a host-resolved record
# (common.query_records) instead of the work list and then the offsets: one load round trip before
# the tiles' loads instead of two, in every program (each program is one block and head here).
# Built 2026-12-05, after that dependent load held 14% of the warp-stall samples of GDPA's
# persistent Gluon forward (Nsight Compute, H100) and records moved those kernels 0.2-1.3 points
# (docs/benchmarks.md). sm_90 ptxas of Triton 3.6 (the GPU machine's), one head per program: the
# backward (4, 1, 1, 0, 1, 0, 1) keeps the pick's 168 registers and 64 KB (three programs per SM),
# the forward's 196 registers with or without (Triton 3.9: backward 164 against 170). GPU tier
# passed (H100, 2026-12-05, `bash scripts/gpu.sh block-records`: the every-candidate test), and in
# two sweeps there the forward ran 132.5 / 132.7 us at self-1000 against 133.5 / 133.5 us for the
# pick, 114.1 / 114.0 against 115.4 / 115.4 us at self-4000, the backward 267.3 / 268.1 against
# 269.2 / 269.5 us and 229.1 / 228.6 against 229.1 / 228.8 us: both join autotuning.
_RECORDS_FWD_CANDIDATES = [(4, 2, 0, 0, 1, 0, 1)]
_RECORDS_BWD_CANDIDATES = [(4, 1, 1, 0, 1, 0, 1)]
_FWD_CANDIDATES += _RECORDS_FWD_CANDIDATES
_BWD_CANDIDATES = [(4, 1, 1), (8, 1, 1), (4, 2, 0), (8, 2, 0), (8, 1, 2), (4, 2, 2),
                   (4, 1, 1, 1), (4, 2, 0, 1), (8, 1, 1, 1),
                   (4, 1, 1, 0, 1), (8, 1, 1, 0, 1), (4, 2, 0, 0, 1), (8, 2, 0, 0, 1), (4, 1, 0, 0, 1),
                   *_HOPPER_BWD_CANDIDATES, *_RECORDS_BWD_CANDIDATES]
# optional-field configs the GPU tier passed, per kernel
_FWD_CHECKED: set = {(4, 2, 0, 0, 1), (4, 1, 1, 0, 0, 3), *_RECORDS_FWD_CANDIDATES}
_BWD_CHECKED: set = {(4, 1, 1, 0, 1), (4, 1, 1, 0, 0, 2), *_RECORDS_BWD_CANDIDATES}
_PENDING_AUTOTUNE = False  # True: autotuning times every candidate (benchmarks of unchecked ones)
# True: both passes rotate bf16 q and k in packed bf16x2 arithmetic on sm_90+ GPUs (_rotate_bf16x2,
# _rope_mode), the backward recomputing p from q and k rotated exactly as the forward rotated them,
# and the Gluon kernels (which rotate in fp32) are left out. Off: both rotate in fp32. The two
# passes must agree: with the packed forward and the fp32 backward the forward's log-sum-exp
# belonged to other scores than the backward's p, and dv's largest element error was 3.1x the bf16
# PyTorch path's (the tier's bound is 2x; H100, 2026-12-05, fp32 tables, lengths 0..129, seeds 0-2:
# 3.12x, 2.56x, 1.30x), against 0.82x, 0.70x, 1.00x with fp32 in both. The packed forward was 4%
# faster (H200, 2026-12-01), 1.2% (H100, 2026-12-05); the packed backward 1-2% slower (H200,
# 2026-12-01).
_PACKED_ROPE = False
_INTERPRET_CONFIG = (1, 1, 0)  # all heads in one program: the CPU tier exercises the head loop


def _tuned(candidates: list, checked: set) -> list:
    return gpu_checked(candidates, 3, checked, _PENDING_AUTOTUNE)


def _eligible(candidates: list, hopper: bool) -> list:
    """The candidates that can run: the Gluon ones (sixth field) only where _hopper_eligible."""
    return candidates if hopper else [c for c in candidates if not config_field(c, 5)]


# ----------------------------------------------------------------------------------------------
@triton.jit
def _rope_rows(COS, SIN, rows, length, stride_rope, offs_half):
    """cos and sin rows (BS, D/2) of positions ``rows`` (fp32); rows >= length read 0."""
    mask = (rows < length)[:, None]
    ptrs = rows[:, None] * stride_rope + offs_half[None, :]
    c = tl.load(COS + ptrs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(SIN + ptrs, mask=mask, other=0.0).to(tl.float32)
    return c, s


@triton.jit
def _rotate(x1, x2, c, s):
    """[x1, x2] -> [x1 c - x2 s, x2 c + x1 s] in fp32 (rotation of each pair by +theta)."""
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _rotate_bf16x2(x1, x2, c, s):
    """_rotate on bf16 tiles in packed bf16x2 arithmetic (sm_90 PTX; not under the interpreter):
    x1 c - x2 s = fma(x2, -s, x1 c) and x2 c + x1 s = fma(x1, s, x2 c), two elements per instruction,
    each product rounded to bf16 before its fma (two roundings per element, where the PyTorch bf16
    path has three: two products and the sum). 4 instructions per two pairs, against ~13 in fp32
    with the bf16 unpacking and packing around them (sm_90 SASS)."""
    ns = -s
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t;
        mul.rn.bf16x2 t, $2, $4;
        fma.rn.bf16x2 $0, $3, $5, t;
        mul.rn.bf16x2 t, $3, $4;
        fma.rn.bf16x2 $1, $2, $6, t;
        }""",
        "=r,=r,r,r,r,r,r", [x1, x2, c, ns, s], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)


@triton.jit
def _load_halves(PTR, DESC, start, first, rows, length, stride_n, stride_h, h, offs_half, c, s,
                 HALF: tl.constexpr, ROPE: tl.constexpr, BY_DESC: tl.constexpr):
    """The two halves (BS, D/2) of head h of a q or k tile, rotated by position when ROPE, in PTR's
    dtype (the dot operands). ROPE == 2 (bf16 on the GPU): the rotation in bf16x2 arithmetic."""
    x1 = load_tile(PTR, DESC, start, first, rows, length, stride_n, h * stride_h, offs_half, BY_DESC)
    x2 = load_tile(PTR, DESC, start, first, rows, length, stride_n, h * stride_h + HALF, offs_half, BY_DESC)
    if ROPE:
        if ROPE == 2:
            x1, x2 = _rotate_bf16x2(x1, x2, c.to(tl.bfloat16), s.to(tl.bfloat16))
        else:
            r1, r2 = _rotate(x1, x2, c, s)
            x1, x2 = r1.to(x1.dtype), r2.to(x2.dtype)
    return x1, x2


@triton.jit
def _block_setup(WORK, OFFSETS, COS, SIN, stride_rope, heads_per_program, num_heads,
                 BLOCK: tl.constexpr, HALF: tl.constexpr, ROPE: tl.constexpr, RECORDS: tl.constexpr = False):
    """Program -> its block: (sequence start, length, the block's first position and positions in
    the sequence, heads [h0, h_end)) and, when ROPE, the block's cos/sin rows (loaded once for all
    its heads). Program pid takes block pid // n_groups, head group pid % n_groups (n_groups =
    cdiv(H, hpp)). RECORDS: WORK is common.query_records (the block's span in its record: one load
    round trip before the tiles' loads instead of the work list's and then the offsets')."""
    pid = tl.program_id(0)
    n_groups = tl.cdiv(num_heads, heads_per_program)
    if RECORDS:
        tile, start, length, _, _ = work_record(WORK, pid // n_groups)
        first = tile * BLOCK
    else:
        first, start, length, _, _, _ = work_item(WORK, OFFSETS, OFFSETS, pid // n_groups, BLOCK)
    h0 = (pid % n_groups) * heads_per_program
    rows = first + tl.arange(0, BLOCK)
    c, s = 0.0, 0.0
    if ROPE:
        c, s = _rope_rows(COS, SIN, rows, length, stride_rope, tl.arange(0, HALF))
    return start, length, first, rows, h0, tl.minimum(h0 + heads_per_program, num_heads), c, s


@triton.jit
def _scores(Q, K, Q_DESC, K_DESC, start, first, rows, length, stride_qn, stride_qh, stride_kn, stride_kh, h, c, s,
            qk_scale, HALF: tl.constexpr, ROPE: tl.constexpr, BY_DESC: tl.constexpr):
    """Rotated q and k halves of one head's block and its scores (BS, BS) in log2 units
    (two dots of depth D/2, one per half)."""
    offs_half = tl.arange(0, HALF)
    q1, q2 = _load_halves(Q, Q_DESC, start, first, rows, length, stride_qn, stride_qh, h, offs_half, c, s, HALF, ROPE,
                          BY_DESC)
    k1, k2 = _load_halves(K, K_DESC, start, first, rows, length, stride_kn, stride_kh, h, offs_half, c, s, HALF, ROPE,
                          BY_DESC)
    scores = (tl.dot(q1, tl.trans(k1)) + tl.dot(q2, tl.trans(k2))) * qk_scale
    return q1, q2, k1, k2, scores


@triton.jit
def _fwd_head(Q, K, V, O, LSE, Q_DESC, K_DESC, V_DESC, h, start, first, rows, length, c, s, num_heads,
              stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh, qk_scale,
              HEAD_DIM: tl.constexpr, ROPE: tl.constexpr, BY_DESC: tl.constexpr, HALVES: tl.constexpr):
    """One head of one block: o and the rows' log2-sum-exp2. BY_DESC: a whole block by TMA (no masks);
    HALVES: v and o in (BS, D/2) halves."""
    offs_d = tl.arange(0, HEAD_DIM)
    _, _, _, _, scores = _scores(Q, K, Q_DESC, K_DESC, start, first, rows, length, stride_qn, stride_qh, stride_kn,
                                 stride_kh, h, c, s, qk_scale, HEAD_DIM // 2, ROPE, BY_DESC)
    if not HALVES:
        v = load_tile(V, V_DESC, start, first, rows, length, stride_vn, h * stride_vh, offs_d, BY_DESC)  # (BS, D)
    if not BY_DESC:
        scores = tl.where((rows < length)[None, :], scores, float("-inf"))
    m = tl.max(scores, 1)  # finite: key row `first` is always valid
    p = tl.math.exp2(scores - m[:, None])
    l = tl.sum(p, 1)
    if HALVES:  # v and o in (BS, D/2) halves, each half of o stored before the next is formed
        offs_half = tl.arange(0, HEAD_DIM // 2)
        p = p.to(V.dtype.element_ty)
        v1 = load_tile(V, V_DESC, start, first, rows, length, stride_vn, h * stride_vh, offs_half, BY_DESC)
        store_rows(O, tl.dot(p, v1) / l[:, None], start, rows, length, stride_on, h * stride_oh, offs_half)
        v2 = load_tile(V, V_DESC, start, first, rows, length, stride_vn, h * stride_vh + HEAD_DIM // 2, offs_half,
                       BY_DESC)
        store_rows(O, tl.dot(p, v2) / l[:, None], start, rows, length, stride_on, h * stride_oh + HEAD_DIM // 2,
                   offs_half)
    else:
        out = tl.dot(p.to(v.dtype), v) / l[:, None]
        store_rows(O, out, start, rows, length, stride_on, h * stride_oh, offs_d)
    tl.store(LSE + (start + rows) * num_heads + h, m + tl.math.log2(l), mask=rows < length)


@triton.jit
def _block_attn_fwd(
    Q, K, V, O, LSE, COS, SIN, Q_DESC, K_DESC, V_DESC, OFFSETS, WORK, num_heads, heads_per_program,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh, stride_rope, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ROPE: tl.constexpr, TMA: tl.constexpr = False,
    HALVES: tl.constexpr = False, RECORDS: tl.constexpr = False,
):
    # Q/K/V/O: [N, H, D] jagged values; LSE: fp32 [N, H] log2-sum-exp2 per row (for the backward);
    # COS/SIN: [>= max_len, D/2] rotation tables (unused unless ROPE); Q_DESC/K_DESC ((BS, D/2)
    # blocks) and V_DESC ((BS, D), or (BS, D/2) with HALVES) over [N, H * D] when TMA; OFFSETS:
    # int64 [B+1]; WORK: int32 [n_work, 2] = (sequence, block); one program per block and group of
    # heads_per_program heads (see _block_setup).
    HALF: tl.constexpr = HEAD_DIM // 2
    start, length, first, rows, h0, h_end, c, s = _block_setup(WORK, OFFSETS, COS, SIN, stride_rope,
                                                               heads_per_program, num_heads, BLOCK, HALF, ROPE,
                                                               RECORDS)
    # TMA: this launch gets whole blocks only (the partial last blocks go to a launch without TMA):
    # one kernel holding both loops would take the masked loop's registers (255 at 4 warps with
    # rope, vs 223 by TMA alone).
    for h in range(h0, h_end):
        _fwd_head(Q, K, V, O, LSE, Q_DESC, K_DESC, V_DESC, h, start, first, rows, length, c, s, num_heads,
                  stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh, qk_scale,
                  HEAD_DIM, ROPE, TMA, HALVES)


@triton.jit
def _bwd_head(Q, K, V, DO, LSE, DQ, DK, DV, COS, SIN, Q_DESC, K_DESC, V_DESC, DO_DESC,
              h, start, first, rows, length, c, s, num_heads,
              stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
              stride_don, stride_doh, stride_dqn, stride_dqh, stride_dkn, stride_dkh, stride_dvn, stride_dvh,
              stride_rope, qk_scale, scale, HEAD_DIM: tl.constexpr, ROPE: tl.constexpr, BY_DESC: tl.constexpr,
              HALVES: tl.constexpr):
    # The order keeps the live set small (at D = 128 one fp32 (BS, D) accumulator is 64 registers
    # per thread of a 4-warp program): dv is stored before v is loaded and dS formed, dq before dk
    # is computed, and c, s are re-read (L1/L2) for each gradient's rotation and returned for the
    # caller's head loop to carry: that ends the setup rows' lifetime at the q/k rotation (keeping
    # them live across the body spilled twice as much: 1,016 vs 592 B per thread at 4 warps, sm_90
    # ptxas with the tables' stride unspecialized, as check_kernels_build compiled it then).
    # Holding dq, dk, dv together spilled ~1 KB per thread; this order measured 0.33 vs
    # 0.41 ms on self-1000 (H200, docs/benchmarks.md).
    # delta = rowsum(p * dp): the whole softmax row is in the tile (one block of keys), so the
    # softmax backward's row term comes from p and dp, which the kernel forms anyway. It equals
    # rowsum(do * o) with o = p v unrounded, and o is not read at all: one (BS, D) tile less to
    # load and to hold (the last version loaded o to form rowsum(do * o) first).
    HALF: tl.constexpr = HEAD_DIM // 2
    row_ok = rows < length
    offs_half = tl.arange(0, HALF)
    offs_d = tl.arange(0, HEAD_DIM)
    if HALVES:  # do, v and dv in (BS, D/2) halves: one fp32 accumulator half as wide (masked loads)
        do1 = load_tile(DO, DO_DESC, start, first, rows, length, stride_don, h * stride_doh, offs_half, False)
        do2 = load_tile(DO, DO_DESC, start, first, rows, length, stride_don, h * stride_doh + HALF, offs_half, False)
    else:
        do = load_tile(DO, DO_DESC, start, first, rows, length, stride_don, h * stride_doh, offs_d, BY_DESC)
    lse = tl.load(LSE + (start + rows) * num_heads + h, mask=row_ok, other=float("inf"))  # inf: p = 0
    q1, q2, k1, k2, scores = _scores(Q, K, Q_DESC, K_DESC, start, first, rows, length, stride_qn, stride_qh, stride_kn,
                                     stride_kh, h, c, s, qk_scale, HALF, ROPE, BY_DESC)
    p = tl.math.exp2(scores - lse[:, None])
    if not BY_DESC:
        p = tl.where(row_ok[None, :], p, 0.0)  # keys beyond L: 0
    if HALVES:
        pt = tl.trans(p.to(do1.dtype))
        store_rows(DV, tl.dot(pt, do1), start, rows, length, stride_dvn, h * stride_dvh, offs_half)
        store_rows(DV, tl.dot(pt, do2), start, rows, length, stride_dvn, h * stride_dvh + HALF, offs_half)
        v1 = load_tile(V, V_DESC, start, first, rows, length, stride_vn, h * stride_vh, offs_half, False)
        dp = tl.dot(do1, tl.trans(v1))
        v2 = load_tile(V, V_DESC, start, first, rows, length, stride_vn, h * stride_vh + HALF, offs_half, False)
        dp = tl.dot(do2, tl.trans(v2), dp)
    else:
        dv = tl.dot(tl.trans(p.to(do.dtype)), do)
        store_rows(DV, dv, start, rows, length, stride_dvn, h * stride_dvh, offs_d)
        v = load_tile(V, V_DESC, start, first, rows, length, stride_vn, h * stride_vh, offs_d, BY_DESC)
        dp = tl.dot(do, tl.trans(v))
    delta = tl.sum(p * dp, 1)  # (BS,)
    ds = p * (dp - delta[:, None])  # gradient of the natural-units score
    ds = ds.to(q1.dtype)
    dq1, dq2 = tl.dot(ds, k1) * scale, tl.dot(ds, k2) * scale
    if ROPE:  # the rotation's backward: rotate the gradients by -theta
        c, s = _rope_rows(COS, SIN, rows, length, stride_rope, offs_half)
        dq1, dq2 = dq1 * c + dq2 * s, dq2 * c - dq1 * s
    store_rows(DQ, dq1, start, rows, length, stride_dqn, h * stride_dqh, offs_half)
    store_rows(DQ, dq2, start, rows, length, stride_dqn, h * stride_dqh + HALF, offs_half)
    ds_t = tl.trans(ds)
    dk1, dk2 = tl.dot(ds_t, q1) * scale, tl.dot(ds_t, q2) * scale
    if ROPE:
        c, s = _rope_rows(COS, SIN, rows, length, stride_rope, offs_half)
        dk1, dk2 = dk1 * c + dk2 * s, dk2 * c - dk1 * s
    store_rows(DK, dk1, start, rows, length, stride_dkn, h * stride_dkh, offs_half)
    store_rows(DK, dk2, start, rows, length, stride_dkn, h * stride_dkh + HALF, offs_half)
    return c, s  # the re-read rows: the caller's loop carries these, not the setup's


@triton.jit
def _block_attn_bwd(
    Q, K, V, DO, LSE, DQ, DK, DV, COS, SIN, Q_DESC, K_DESC, V_DESC, DO_DESC, OFFSETS, WORK, num_heads,
    heads_per_program,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_don, stride_doh, stride_dqn, stride_dqh, stride_dkn, stride_dkh, stride_dvn, stride_dvh,
    stride_rope, qk_scale, scale,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ROPE: tl.constexpr, TMA: tl.constexpr = False,
    HALVES: tl.constexpr = False, RECORDS: tl.constexpr = False,
):
    # Same work items as the forward. Each program reads q, k, v, do and lse of its block once and
    # writes dq, dk, dv once; the softmax backward's row term comes from p and dp (_bwd_head), so
    # neither a pre-pass nor the forward's output is needed.
    # TMA: whole blocks' q, k (halves), v, do through the descriptors, as in the forward.
    HALF: tl.constexpr = HEAD_DIM // 2
    start, length, first, rows, h0, h_end, c, s = _block_setup(WORK, OFFSETS, COS, SIN, stride_rope,
                                                               heads_per_program, num_heads, BLOCK, HALF, ROPE,
                                                               RECORDS)
    for h in range(h0, h_end):  # TMA: whole blocks only, as in the forward
        c, s = _bwd_head(Q, K, V, DO, LSE, DQ, DK, DV, COS, SIN, Q_DESC, K_DESC, V_DESC, DO_DESC,
                         h, start, first, rows, length, c, s, num_heads,
                         stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                         stride_don, stride_doh, stride_dqn, stride_dqh, stride_dkn, stride_dkh, stride_dvn, stride_dvh,
                         stride_rope, qk_scale, scale, HEAD_DIM, ROPE, TMA, HALVES)


# ----------------------------------------------------------------------------------------------
# Host side: rope tables, launchers, autograd.

_rope_cache: dict = {}


def rope_tables(base: float, length: int, dim: int, device, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[>= length, dim // 2]`` of positions r and frequencies base ** (-i / (dim / 2)),
    computed in float64 and stored in ``dtype``; cached on the device per (base, dim, dtype), grown
    to the next power of two of ``length`` so a new batch does not rebuild them."""
    key = (float(base), dim, torch.device(device), dtype)
    tables = _rope_cache.get(key)
    if tables is None or tables[0].shape[0] < length:
        tables = rope_cos_sin(bucket_len(max(length, 1)), dim, base, device, dtype)
        _rope_cache[key] = tables
    return tables


def _rope_args(cos, sin, rope_base, max_len, q):
    """(cos, sin, ROPE) for the kernels: the given tables, tables built from a base frequency, or
    (without rope) q as a placeholder pointer that the kernels never read."""
    if cos is None and rope_base:
        cos, sin = rope_tables(rope_base, max_len, q.shape[-1], q.device, rope_table_dtype(q.dtype))
    if cos is None:
        return q, q, False
    return cos, sin, True


def _table_key(cos, rope: bool):
    """The rope part of an autotune key: the tables' dtype (the best backward differs between fp16
    and fp32 tables: the half-width config by 10%+ with fp16, the full-width one with fp32; H200,
    2026-12-01), False without rope."""
    return str(cos.dtype).removeprefix("torch.") if rope else False


def _descriptors(cfg, block_size, halves, wholes) -> tuple:
    """The TMA descriptors of a config with the TMA field set: (BS, D/2) blocks over ``halves`` (q,
    k; v too in the half-width forward), (BS, D) over ``wholes``; all None (masked loads, same
    values) without it or where a tensor's layout does not allow them."""
    off = (None,) * (len(halves) + len(wholes))
    if not config_field(cfg, 3):
        return off
    half = halves[0].shape[-1] // 2
    a, b = row_descriptors(block_size, *halves, cols=half), row_descriptors(block_size, *wholes)
    return off if a is None or b is None else (*a, *b)


def _rope_mode(rope: bool, q: torch.Tensor) -> int:
    """The kernels' ROPE constexpr, the same for both passes (the backward recomputes the forward's
    scores): 0 without rope, 1 rotation in fp32, 2 in packed bf16x2 (_rotate_bf16x2) where
    _PACKED_ROPE asks for it: bf16 inputs on an NVIDIA GPU of compute capability 9.0 or newer
    (mul.bf16x2 needs sm_90), compiled (not under the interpreter). Mode 2 runs the Triton kernels
    only (_gluon_rotation)."""
    if not rope:
        return 0
    return 2 if _PACKED_ROPE and q.dtype == torch.bfloat16 and _sm90(q.device) else 1


def _gluon_rotation(mode: int, cfg) -> None:
    """The Gluon kernels rotate in fp32: a Gluon config under the packed rotation (mode 2) would
    pair with a pass that rotates otherwise. ValueError: autotuning takes the next candidate (the
    candidates leave them out already), a pinned config raises."""
    if mode == 2:
        raise ValueError(f"block_attention: config {tuple(cfg)} is a Gluon kernel, which rotates in fp32; the packed "
                         "bf16x2 rotation (_PACKED_ROPE) runs the Triton kernels only")


@functools.cache
def _sm90(device: torch.device) -> bool:
    """Compiled kernels on an NVIDIA GPU of compute capability >= 9.0 (inline sm_90 PTX runs)."""
    return (not INTERPRET and device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device) >= (9, 0))


def _launch(kernel, offsets, heads, block_size, cfg, args, descs, dim, rope_mode, device, **flags):
    """One launch over every block, or with descriptors two: whole blocks by TMA, then the partial
    last blocks by masked loads (same values either way; the rows are disjoint). ``rope_mode``: see
    _rope_mode; ``flags``: the kernel's constexpr variants (HALVES), the same in both launches."""
    warps, stages, per_program = cfg[:3]
    per_program = heads if per_program <= 0 else min(per_program, heads)
    if flags.get("RECORDS"):
        if descs[0] is not None:
            raise ValueError(f"block_attention: config {cfg} asks for work records with TMA; records are built for the "
                             "masked-load kernels only")
        launches = [(query_records(offsets, offsets, block_size, False, device), descs)]
    elif descs[0] is None:
        launches = [(query_work(offsets, offsets, block_size, False, device), descs)]
    else:
        whole, partial = whole_tile_work(offsets, block_size, device)
        launches = [(whole, descs), (partial, (None,) * len(descs))]
    for work, tiles in launches:
        n_programs = work.shape[0] * cdiv(heads, per_program)
        if n_programs:
            kernel[(n_programs,)](*args[:-1], *tiles, offsets, work, heads, per_program, *args[-1],
                                  HEAD_DIM=dim, BLOCK=block_size, ROPE=rope_mode, TMA=tiles[0] is not None,
                                  num_warps=warps, num_stages=stages, **flags)


def _forward(q, k, v, cos, sin, offsets, max_len, block_size, rope_base, scale):
    n, heads, dim = q.shape
    out = torch.empty_like(q)  # every row belongs to one block, which writes it
    lse = torch.empty(n, heads, device=q.device, dtype=torch.float32)
    cos, sin, rope = _rope_args(cos, sin, rope_base, max_len, q)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
               cos.stride(0), scale * LOG2E)

    mode = _rope_mode(rope, q)

    def run(cfg):
        if config_field(cfg, 5):  # the Gluon kernel for Hopper (fp32 rotation)
            _gluon_rotation(mode, cfg)
            records = query_records(offsets, offsets, block_size, False, q.device)
            _hopper(q.device).forward(q, k, v, out, lse, cos, sin, records, block_size, rope, scale * LOG2E,
                                      config_field(cfg, 5))
            return
        halves = bool(config_field(cfg, 4))  # v by (BS, D/2) blocks too
        descs = _descriptors(cfg, block_size, (q, k, v) if halves else (q, k), () if halves else (v,))
        _launch(_block_attn_fwd, offsets, heads, block_size, cfg, (q, k, v, out, lse, cos, sin, strides), descs, dim,
                mode, q.device, HALVES=halves, RECORDS=bool(config_field(cfg, 6)))

    # the rotation's arithmetic (mode) too: configs timed with one are not the other's; and whether
    # the Gluon configs can run on these inputs
    hopper = (mode != 2 and _hopper_tunable(_HOPPER_FWD_CANDIDATES, _FWD_CHECKED)
              and _hopper_eligible(block_size, rope, cos, sin, q, k, v, out))
    key = ("block_attention_fwd", dim, q.dtype, block_size, _table_key(cos, rope), mode, heads, bucket_len(n), hopper)
    run(pick_config(key, lambda: _tuned(_eligible(_FWD_CANDIDATES, hopper), _FWD_CHECKED), run, _INTERPRET_CONFIG))
    return out, lse


def _backward(do, q, k, v, lse, cos, sin, offsets, max_len, block_size, rope_base, scale):
    n, heads, dim = q.shape
    do = do if do.stride(-1) == 1 else do.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    cos, sin, rope = _rope_args(cos, sin, rope_base, max_len, q)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0),
               do.stride(1), dq.stride(0), dq.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
               cos.stride(0), scale * LOG2E, scale)
    mode = _rope_mode(rope, q)  # the forward's

    def run(cfg):
        if config_field(cfg, 5):  # the Gluon kernel for Hopper
            _gluon_rotation(mode, cfg)
            pair = bool(config_field(cfg, 8))  # the paired backward builds its own records
            records = None if pair else query_records(offsets, offsets, block_size, False, q.device)
            _hopper(q.device).backward(q, k, v, do, lse, dq, dk, dv, cos, sin, records, block_size, rope,
                                       scale * LOG2E, scale, config_field(cfg, 5), pair=pair, offsets=offsets)
            return
        args = (q, k, v, do, lse, dq, dk, dv, cos, sin, strides)
        descs = _descriptors(cfg, block_size, (q, k), (v, do))
        _launch(_block_attn_bwd, offsets, heads, block_size, cfg, args, descs, dim, mode, q.device,
                HALVES=bool(config_field(cfg, 4)), RECORDS=bool(config_field(cfg, 6)))

    hopper = (mode != 2 and _hopper_tunable(_HOPPER_BWD_CANDIDATES, _BWD_CHECKED)
              and _hopper_eligible(block_size, rope, cos, sin, q, k, v, do, dq, dk, dv))
    key = ("block_attention_bwd", dim, q.dtype, block_size, _table_key(cos, rope), mode, heads, bucket_len(n), hopper)
    run(pick_config(key, lambda: _tuned(_eligible(_BWD_CANDIDATES, hopper), _BWD_CHECKED), run, _INTERPRET_CONFIG))
    return dq, dk, dv


def _hopper(device: torch.device):
    """gemctl.ops.triton.block_attention_hopper, or ValueError where it cannot run on ``device``
    (common.gluon_module): autotuning then takes the next candidate, a pinned config raises."""
    return gluon_module("block_attention_hopper", "block_attention", device)


def _hopper_runs(device: torch.device) -> bool:
    """An sm_90+ GPU and a Triton with Gluon's Hopper API (asked once per device)."""
    return gluon_runs("block_attention_hopper", device)


def _hopper_tunable(hopper_candidates: list, checked: set) -> bool:
    """Whether autotuning could time any Gluon config of a pass (one the GPU tier passed, or every
    candidate with _PENDING_AUTOTUNE): only then is _hopper_eligible's per-call check worth its host
    time (a stride and alignment read per tensor)."""
    return _PENDING_AUTOTUNE or not checked.isdisjoint(hopper_candidates)


def _hopper_eligible(block_size: int, rope: bool, cos, sin, *tensors) -> bool:
    """Whether the Gluon configs can run on these inputs: part of the autotune key, so that a pick is
    never reused for inputs it cannot take (block 64, bf16/fp16, head_dim 64/128, an sm_90+ GPU,
    every tensor readable by TMA in (64, D/2) boxes, the rope tables too)."""
    q = tensors[0]
    if block_size != 64 or q.shape[2] not in (64, 128) or not _hopper_runs(q.device):
        return False
    from gemctl.ops.triton import block_attention_hopper as bh  # imported once _hopper_runs said it can be

    return bh.tiles_viewable(*tensors) and (not rope or bh.tables_viewable(cos, sin))


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
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
    cos: torch.Tensor | None, sin: torch.Tensor | None, offsets: torch.Tensor, max_len: int, block_size: int,
    rope_base: float, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, cos, sin = _contiguous_dim(q, k, v, cos, sin)
    return _backward(do, q, k, v, lse, cos, sin, offsets, max_len, block_size, rope_base, scale)


@_block_attention_bwd_op.register_fake
def _(do, q, k, v, lse, cos, sin, offsets, max_len, block_size, rope_base, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cos, sin, offsets, *args = inputs
    ctx.save_for_backward(q, k, v, output[1], cos, sin, offsets)  # the backward does not read o
    ctx.args = tuple(args)


def _backward_rule(ctx, do, _dlse):
    q, k, v, lse, cos, sin, offsets = ctx.saved_tensors
    dq, dk, dv = _block_attention_bwd_op(do, q, k, v, lse, cos, sin, offsets, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None


torch.library.register_autograd("gemctl::block_attention_fwd", _backward_rule, setup_context=_setup_context)


class _BlockAttentionEager(torch.autograd.Function):
    """The custom ops' forward and backward for eager mode, without the custom-op wrapper's host cost."""

    @staticmethod
    def forward(ctx, q, k, v, cos, sin, offsets, max_len, block_size, rope_base, scale):
        q, k, v, cos, sin = _contiguous_dim(q, k, v, cos, sin)
        out, lse = _forward(q, k, v, cos, sin, offsets, max_len, block_size, rope_base, scale)
        ctx.save_for_backward(q, k, v, lse, cos, sin, offsets)  # the backward does not read o
        ctx.args = (max_len, block_size, rope_base, scale)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, lse, cos, sin, offsets = ctx.saved_tensors
        dq, dk, dv = _backward(do, q, k, v, lse, cos, sin, offsets, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None


def block_attention_triton(q, k, v, offsets, max_len, *, block_size=64, rope=None, scale=None):
    """Triton implementation of :func:`gemctl.ops.block_attention` (same signature, minus backend,
    plus ``scale``, default D**-0.5). ``rope`` is ``(cos, sin)`` tables ``[>= max_len, D // 2]`` or a
    float base frequency (tables built and cached on the device, see :func:`rope_tables`)."""
    dim = q.shape[-1]
    if dim not in BLOCK_KERNEL_DIMS:  # gemctl.ops.block_kernel_takes: backend="auto" sends only these here
        raise ValueError(f"block_attention (triton): head_dim must be one of {BLOCK_KERNEL_DIMS}; got {dim}")
    if block_size not in BLOCK_KERNEL_SIZES:
        raise ValueError(f"block_attention (triton): block_size must be one of {BLOCK_KERNEL_SIZES}; got {block_size}")
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
        if cos.dtype != sin.dtype or not cos.dtype.is_floating_point:
            raise ValueError(f"block_attention: rope tables cos and sin must share one float dtype, got {cos.dtype} "
                             f"and {sin.dtype}")
        cos, sin = cos.detach(), sin.detach()
        if cos.stride() != sin.stride():  # the kernels step both by one row stride
            cos, sin = cos.contiguous(), sin.contiguous()
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"block_attention (triton): q, k and v must share one dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    scale = dim**-0.5 if scale is None else float(scale)
    args = (q, k, v, cos, sin, offsets, int(max_len), int(block_size), rope_base, scale)
    if torch.compiler.is_compiling():  # traced as a custom op: no graph break
        return _block_attention_fwd_op(*args)[0]
    return _BlockAttentionEager.apply(*args)
