"""RMSNorm backward in one pass: dx and the weight's gradient from one read of dy and x.

The fused FP8 producers (gemctl.ops.triton.fp8_gemm: fp8_rmsnorm_cast_rows) compute the norm's
forward inside the cast of the next GEMM's operand and keep only the rows' rstd; this is its
backward. For y = (x * rstd) * w with rstd = 1 / sqrt(mean(x^2) + eps), xhat = x * rstd and
g = dy * w:

    dx = rstd * (g - xhat * mean(g * xhat))        dw = sum over rows of dy * xhat

Each program holds whole rows in registers (up to 8192 values), walks ITERS blocks of BLOCK_R
rows, writes their dx and keeps its rows' dw sums in registers, then writes one float32 row of
partial sums; a column sum over the programs' rows gives dw. Reads 2 tensors, writes 1: on the H200
at [65536, 1024] torch's fused RMSNorm backward (aten::_fused_rms_norm_backward) took 0.34 ms, 0.22
of them in the weight-gradient reduction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemctl.ops.triton.common import bucket_len, cdiv, next_pow2, pick_config

ROWS_IN_REGISTERS = 8192  # the widest rows held whole
ROWS_PER_PROGRAM = 64  # ~1024 programs at 65,536 rows; the partial sums are [programs, C] float32
# (BLOCK_R, warps): rows per block held at once
_CANDIDATES = [(1, 4), (2, 4), (4, 4), (1, 8), (2, 8), (4, 8), (1, 2), (2, 2)]
_INTERPRET_CONFIG = (2, 1)


@triton.jit(do_not_specialize=["R"])  # per-batch sizes: common.py, "Specialization"
def _rms_norm_bwd_kernel(
    DY, X, RSTD, W, DX, DWP, R, Cn, stride_dy, stride_x, stride_dx, stride_dwp,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ITERS: tl.constexpr, NEED_DW: tl.constexpr,
):
    pid = tl.program_id(0)
    cc = tl.arange(0, BLOCK_C)
    cmask = cc < Cn
    w = tl.load(W + cc, mask=cmask, other=0.0)
    dw = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for i in range(ITERS):
        rr = (pid * ITERS + i) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rr < R
        mask = rmask[:, None] & cmask[None, :]
        r64 = rr.to(tl.int64)[:, None]
        dy = tl.load(DY + r64 * stride_dy + cc[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + r64 * stride_x + cc[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rr, mask=rmask, other=0.0)
        xhat = x * rstd[:, None]
        g = dy * w[None, :]
        mean = tl.sum(g * xhat, axis=1) / Cn
        dx = rstd[:, None] * (g - xhat * mean[:, None])
        tl.store(DX + r64 * stride_dx + cc[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if NEED_DW:
            dw += dy * xhat
    if NEED_DW:
        tl.store(DWP + pid.to(tl.int64) * stride_dwp + cc, tl.sum(dw, axis=0), mask=cmask)


def applied_weight(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The norm's weight as the unfused norm applies it (gemctl.model.norm): in x's dtype, then
    float32 for this backward's math. The fused forward casts apply the same values in their kernels
    (fp8_gemm._norm_weight), without a conversion kernel of their own."""
    return weight.detach().to(x.dtype).float().contiguous()


def fits(x: torch.Tensor) -> bool:
    """Rows narrow enough to be held whole (rms_norm_backward takes them)."""
    return x.dim() == 2 and x.shape[1] <= ROWS_IN_REGISTERS


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
                      need_dw: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dx, dweight)`` of ``y = (x * rstd) * w`` for x, dy [R, C] (C <= 8192), rstd [R] float32 and
    the weight [C] as the forward applied it (``w = weight`` in x's dtype, then float32); dx in x's
    dtype, dweight in weight's dtype (None unless need_dw)."""
    if not fits(x) or dy.shape != x.shape or tuple(rstd.shape) != (x.shape[0],) or tuple(weight.shape) != (x.shape[1],):
        raise ValueError(f"rms_norm_backward: dy and x [R, C <= {ROWS_IN_REGISTERS}], rstd [R], weight [C] expected, "
                         f"got {tuple(dy.shape)}, {tuple(x.shape)}, {tuple(rstd.shape)}, {tuple(weight.shape)}")
    dy, x = dy.contiguous(), x.contiguous()
    r, c = x.shape
    w = applied_weight(weight, x)
    rstd = rstd.float().contiguous()
    dx = torch.empty_like(x)
    rows = ROWS_PER_PROGRAM
    n_prog = cdiv(r, rows)
    dwp = torch.empty((n_prog, c), dtype=torch.float32, device=x.device) if need_dw else rstd
    if r:
        def run(cfg):
            br, warps = cfg
            _rms_norm_bwd_kernel[(n_prog,)](
                dy, x, rstd, w, dx, dwp, r, c, dy.stride(0), x.stride(0), dx.stride(0), dwp.stride(0) if need_dw else 0,
                BLOCK_R=br, BLOCK_C=next_pow2(c), ITERS=rows // br, NEED_DW=need_dw, num_warps=warps)

        key = ("rms_norm_bwd", bucket_len(r), bucket_len(c), x.dtype, need_dw)
        run(pick_config(key, _CANDIDATES, run, _INTERPRET_CONFIG))
    if not need_dw:
        return dx, None
    dweight = dwp.sum(0) if r else torch.zeros(c, dtype=torch.float32, device=x.device)
    return dx, dweight.to(weight.dtype)
