"""GELU variants for a timing probe of the GDPA forward (not product code): which share of the
cross-128 forward the activation's arithmetic takes, and what packed half arithmetic buys.

    relu     the cost floor: one max per score (wrong values, timing only)
    fp32     the committed polynomial restructured: y = 0.5 x + |x| min(1/2, |x| P(t) / 2), fp32
    f16x2    the erf factor a = min(1/2, |w| Q(v)), w = x / sqrt 8, v = w^2 - 1, in packed f16x2
             arithmetic (two scores per instruction), then y = 0.5 x + |x| a in fp32
"""

import math

import torch
import triton
import triton.language as tl

from gemctl.ops.triton import gdpa

Q_V = (4.977189356e-01, -2.387945317e-01, 1.567236279e-01, -1.003026992e-01, 6.814002358e-02,
       -4.681294918e-02, 1.689124727e-02)  # |w| Q(v) ~ erf(|x| / sqrt 2) / 2, minimax in float64


def _h2(c: float) -> str:
    b = torch.tensor(c, dtype=torch.float16).view(torch.int16).item() & 0xFFFF
    return f"0x{b:04x}{b:04x}"


def _asm() -> str:
    lines = [".reg .b32 h, w, v, q, a, c;", ".reg .b16 lo, hi;",
             "cvt.rn.f16x2.f32 h, $3, $2;",
             f"mov.b32 c, {_h2(1 / math.sqrt(8))};", "mul.rn.f16x2 w, h, c;",
             f"mov.b32 c, {_h2(-1.0)};", "fma.rn.f16x2 v, w, w, c;",
             f"mov.b32 c, {_h2(1.0)};", "min.f16x2 v, v, c;",
             f"mov.b32 q, {_h2(Q_V[-1])};"]
    for coef in Q_V[-2::-1]:
        lines += [f"mov.b32 c, {_h2(coef)};", "fma.rn.f16x2 q, q, v, c;"]
    lines += ["and.b32 w, w, 0x7fff7fff;", "mul.rn.f16x2 a, w, q;",
              f"mov.b32 c, {_h2(0.5)};", "min.f16x2 a, a, c;",
              "mov.b32 {lo, hi}, a;", "cvt.f32.f16 $0, lo;", "cvt.f32.f16 $1, hi;"]
    return "{\n" + "\n".join(lines) + "\n}"


_ASM = tl.constexpr(_asm())
_PH = tuple(tl.constexpr(c / 2) for c in gdpa.GELU_P)


@triton.jit
def gelu_relu(s):
    return tl.maximum(s, 0.0)


@triton.jit
def gelu_fp32(s):
    t = tl.minimum(s * s, 16.0)
    p = (((((_PH[6] * t + _PH[5]) * t + _PH[4]) * t + _PH[3]) * t + _PH[2]) * t + _PH[1]) * t + _PH[0]
    a = tl.minimum(tl.abs(s) * p, 0.5)
    return tl.fma(tl.abs(s), a, 0.5 * s)


@triton.jit
def gelu_f16x2(s):
    a = tl.inline_asm_elementwise(_ASM, "=r,=r,r,r", [s], dtype=tl.float32, is_pure=True, pack=2)
    return tl.fma(tl.abs(s), a, 0.5 * s)


VARIANTS = {"relu": gelu_relu, "fp32": gelu_fp32, "f16x2": gelu_f16x2}


def apply(name: str) -> None:
    """Route the GDPA kernels' GELU through variant ``name`` (before anything compiles)."""
    if name != "committed":
        gdpa._gelu_poly = VARIANTS[name]


@triton.jit
def _elementwise(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0)
    tl.store(Y + offs, gdpa._act(x, 0), mask=offs < n)


def values(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    _elementwise[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    return y
