"""GDPA in Triton: out_i = sum_j act(scale * q_i . k_j) v_j over the valid keys of the sequence.

No softmax and no normalization (callers scale). One kernel family covers the three GEM shapes:
PMA (a few queries per sample over jagged K/V), cross-attention (jagged Q over a few K/V tokens per
sample) and self-attention (jagged Q = K/V); the per-sample counts live in the offsets.
Activations: exact erf-GELU and SiLU, with their derivatives fused into the backward.
Supported: q [Nq, H, D], k/v [Nk, H, D], int64 offsets [B+1], D in {16, 32, 64, 128, 256},
fp16/bf16 on CUDA, fp32 everywhere (CPU tier under TRITON_INTERPRET=1).

No masks at all: rows and keys outside a sequence are loaded as zeros, and act(0) = 0 for both
activations, so a padded key contributes act(0) * 0 = 0 to the output and (do . 0) * act'(0) = 0
to the gradients; out-of-range rows are never stored.

Scheduling: host-built lists of valid (sequence, tile) pairs, longest first (ops/triton/common.py).
Backward: dK/dV per key tile over the query tiles, dQ per query tile over the key tiles; no
atomics, bitwise reproducible.

Status: correctness-tested under the interpreter and compiled for sm_90 in CI; not yet measured
on a GPU, so backend="auto" does not pick it yet (backend="triton" does).
Known limits: the activation uses the erf special function (GEM replaces it with a 6th-order
polynomial); no TMA or persistent zigzag scheduling yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemctl.ops.triton.common import (
    bucket_len, key_work, load_rows, pick_config, query_work, store_rows, work_item,
)

ACTIVATIONS = {"gelu": 0, "silu": 1}
_FWD_CANDIDATES = [(64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3), (128, 32, 4, 3)]
_DKDV_CANDIDATES = [(64, 64, 4, 2), (32, 128, 4, 3), (32, 64, 4, 3)]
_DQ_CANDIDATES = [(64, 64, 4, 2), (128, 32, 4, 3), (64, 32, 4, 3)]
_SQRT1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _act(s, ACT: tl.constexpr):
    if ACT == 0:  # exact GELU: x * Phi(x)
        return 0.5 * s * (1.0 + tl.math.erf(s * _SQRT1_2))
    else:  # SiLU: x * sigmoid(x)
        return s * tl.sigmoid(s)


@triton.jit
def _act_and_grad(s, ACT: tl.constexpr):
    if ACT == 0:  # GELU'(x) = Phi(x) + x * phi(x)
        cdf = 0.5 * (1.0 + tl.math.erf(s * _SQRT1_2))
        return s * cdf, cdf + s * _INV_SQRT_2PI * tl.exp(-0.5 * s * s)
    else:  # SiLU'(x) = sigmoid(x) * (1 + x * (1 - sigmoid(x)))
        sig = tl.sigmoid(s)
        return s * sig, sig * (1.0 + s * (1.0 - sig))


@triton.jit
def _gdpa_fwd(
    Q, K, V, O, Q_OFFSETS, K_OFFSETS, WORK,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh, scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACT: tl.constexpr,
):
    # WORK: int32 [n_work, 2] = (sequence, query tile); program (pid, h) writes BLOCK_M rows.
    pid = tl.program_id(0)
    h = tl.program_id(1)
    m0, q_start, q_len, k_start, k_len, shift = work_item(WORK, Q_OFFSETS, K_OFFSETS, pid, BLOCK_M)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = load_rows(Q, q_start, offs_m, q_len, stride_qn, h * stride_qh, offs_d)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(0, k_len, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        kmask = cols < k_len
        k = tl.load(K + (k_start + cols)[None, :] * stride_kn + h * stride_kh + offs_d[:, None], mask=kmask[None, :], other=0.0)  # (D, BN)
        v = load_rows(V, k_start, cols, k_len, stride_vn, h * stride_vh, offs_d)  # (BN, D)
        a = _act(tl.dot(q, k) * scale, ACT)  # padded keys: s = 0 -> act = 0
        acc += tl.dot(a.to(v.dtype), v)
    store_rows(O, acc, q_start, offs_m, q_len, stride_on, h * stride_oh, offs_d)


@triton.jit
def _gdpa_bwd_dkdv(
    Q, K, V, DO, DK, DV, Q_OFFSETS, K_OFFSETS, WORK,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_don, stride_doh, stride_dkn, stride_dkh, stride_dvn, stride_dvh, scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACT: tl.constexpr,
):
    # WORK: (sequence, key tile); program (pid, h) owns BLOCK_N keys and loops over query tiles.
    pid = tl.program_id(0)
    h = tl.program_id(1)
    n0, q_start, q_len, k_start, k_len, shift = work_item(WORK, Q_OFFSETS, K_OFFSETS, pid, BLOCK_N)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k = load_rows(K, k_start, offs_n, k_len, stride_kn, h * stride_kh, offs_d)
    v = load_rows(V, k_start, offs_n, k_len, stride_vn, h * stride_vh, offs_d)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for start_m in range(0, q_len, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = load_rows(Q, q_start, offs_m, q_len, stride_qn, h * stride_qh, offs_d)
        do = load_rows(DO, q_start, offs_m, q_len, stride_don, h * stride_doh, offs_d)
        a, da = _act_and_grad(tl.dot(q, tl.trans(k)) * scale, ACT)  # (BM, BN)
        dv += tl.dot(tl.trans(a.to(do.dtype)), do)
        ds = tl.dot(do, tl.trans(v)) * da
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    store_rows(DK, dk * scale, k_start, offs_n, k_len, stride_dkn, h * stride_dkh, offs_d)
    store_rows(DV, dv, k_start, offs_n, k_len, stride_dvn, h * stride_dvh, offs_d)


@triton.jit
def _gdpa_bwd_dq(
    Q, K, V, DO, DQ, Q_OFFSETS, K_OFFSETS, WORK,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_don, stride_doh, stride_dqn, stride_dqh, scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACT: tl.constexpr,
):
    # WORK: (sequence, query tile); program (pid, h) owns BLOCK_M query rows, loops over keys.
    pid = tl.program_id(0)
    h = tl.program_id(1)
    m0, q_start, q_len, k_start, k_len, shift = work_item(WORK, Q_OFFSETS, K_OFFSETS, pid, BLOCK_M)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = load_rows(Q, q_start, offs_m, q_len, stride_qn, h * stride_qh, offs_d)
    do = load_rows(DO, q_start, offs_m, q_len, stride_don, h * stride_doh, offs_d)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(0, k_len, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_rows(K, k_start, offs_n, k_len, stride_kn, h * stride_kh, offs_d)
        v = load_rows(V, k_start, offs_n, k_len, stride_vn, h * stride_vh, offs_d)
        a, da = _act_and_grad(tl.dot(q, tl.trans(k)) * scale, ACT)
        ds = tl.dot(do, tl.trans(v)) * da
        dq += tl.dot(ds.to(k.dtype), k)
    store_rows(DQ, dq * scale, q_start, offs_m, q_len, stride_dqn, h * stride_dqh, offs_d)


# ----------------------------------------------------------------------------------------------
# Host side.


def _forward(q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, act, scale):
    heads, dim = q.shape[1], q.shape[2]
    out = torch.empty_like(q)  # every query tile is launched; with no keys it writes zeros

    def run(cfg):
        bm, bn, warps, stages = cfg
        work = query_work(q_offsets, k_offsets, bm, False, q.device)
        if work.shape[0]:
            _gdpa_fwd[(work.shape[0], heads)](
                q, k, v, out, q_offsets, k_offsets, work,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1), scale,
                HEAD_DIM=dim, BLOCK_M=bm, BLOCK_N=bn, ACT=act, num_warps=warps, num_stages=stages,
            )

    key = ("gdpa_fwd", dim, q.dtype, act, bucket_len(max_q_len), bucket_len(max_k_len))
    run(pick_config(key, _FWD_CANDIDATES, run))
    return out


def _backward(do, q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, act, scale):
    heads, dim = q.shape[1], q.shape[2]
    do = do if do.stride(-1) == 1 else do.contiguous()
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    def run_dkdv(cfg):
        bm, bn, warps, stages = cfg
        work = key_work(q_offsets, k_offsets, bn, False, q.device)
        if work.shape[0]:
            _gdpa_bwd_dkdv[(work.shape[0], heads)](
                q, k, v, do, dk, dv, q_offsets, k_offsets, work,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), scale,
                HEAD_DIM=dim, BLOCK_M=bm, BLOCK_N=bn, ACT=act, num_warps=warps, num_stages=stages,
            )

    def run_dq(cfg):
        bm, bn, warps, stages = cfg
        work = query_work(q_offsets, k_offsets, bm, False, q.device)
        if work.shape[0]:
            _gdpa_bwd_dq[(work.shape[0], heads)](
                q, k, v, do, dq, q_offsets, k_offsets, work,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                do.stride(0), do.stride(1), dq.stride(0), dq.stride(1), scale,
                HEAD_DIM=dim, BLOCK_M=bm, BLOCK_N=bn, ACT=act, num_warps=warps, num_stages=stages,
            )

    key = (dim, q.dtype, act, bucket_len(max_q_len), bucket_len(max_k_len))
    run_dkdv(pick_config(("gdpa_dkdv",) + key, _DKDV_CANDIDATES, run_dkdv))
    run_dq(pick_config(("gdpa_dq",) + key, _DQ_CANDIDATES, run_dq))
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


def gdpa_triton(q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, *, activation="gelu", scale=None):
    """Triton implementation of :func:`gemctl.ops.gdpa` (same signature, minus backend)."""
    dim = q.shape[-1]
    if dim not in (16, 32, 64, 128, 256):
        raise ValueError(f"gdpa (triton): head_dim must be one of 16, 32, 64, 128, 256; got {dim}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"gdpa: activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    scale = dim**-0.5 if scale is None else float(scale)
    return _gdpa_fwd_op(q, k, v, q_offsets, k_offsets, int(max_q_len), int(max_k_len), ACTIVATIONS[activation], scale)
