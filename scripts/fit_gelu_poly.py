"""Derive the polynomial GELU the Triton GDPA kernels use instead of the erf special function.

    python scripts/fit_gelu_poly.py [--clamp 4.0] [--degree 7] [--grad-degree 8]

Form (t = min(x^2, c^2)):
    gelu(x)  ~ 0.5 * (x + t * P(t))          for |x| < c,  relu(x) beyond
    gelu'(x) ~ 0.5 + x * S(t)                for |x| < c,  step(x) beyond
x * erf(x / sqrt 2) is even in x and tends to |x|, so P is a polynomial in t = x^2; gelu' - 1/2 is
odd. Coefficients: minimax on [0, c] (Lawson's iteratively reweighted least squares in a scaled
variable, float64), printed as float32 literals; the errors reported are of the float32 Horner
evaluation the kernel performs, over x in [-12, 12], against the exact erf GELU in float64.
"""

from __future__ import annotations

import argparse
import math

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gemctl.ops.triton import gdpa  # noqa: E402


def exact(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cdf = 0.5 * (1 + torch.special.erf(x / math.sqrt(2)))
    return x * cdf, cdf + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def minimax(target: torch.Tensor, t: torch.Tensor, degree: int, c: float, first_power: int) -> list[float]:
    """Coefficients a_i of sum_i a_i t^(i + first_power), i < degree, minimising max |error|."""
    s = t / (c * c)  # scaled variable keeps the normal equations well conditioned
    basis = torch.stack([s ** (i + first_power) for i in range(degree)], 1)
    w = torch.ones_like(t)
    for _ in range(300):
        sol = torch.linalg.lstsq(basis * w[:, None], (target * w)[:, None]).solution[:, 0]
        err = (basis @ sol - target).abs()
        w = w * (err + 1e-15).sqrt()
        w = w / w.max()
    return [float(a) / (c * c) ** (i + first_power) for i, a in enumerate(sol)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clamp", type=float, default=4.0)
    ap.add_argument("--degree", type=int, default=7)
    ap.add_argument("--grad-degree", type=int, default=8)
    args = ap.parse_args()
    c = args.clamp
    x = torch.linspace(0, c, 40001, dtype=torch.float64)[1:]
    value, grad = exact(x)
    p = minimax(2 * value - x, x * x, args.degree, c, 1)  # t * P(t) = x * erf(x / sqrt 2)
    s = minimax((grad - 0.5) / x, x * x, args.grad_degree, c, 0)
    p32 = tuple(float(torch.tensor(a, dtype=torch.float32)) for a in p)
    s32 = tuple(float(torch.tensor(a, dtype=torch.float32)) for a in s)
    # Evaluate exactly as the kernels do: gemctl's reference with these coefficients, in float32.
    saved = gdpa.GELU_CLAMP, gdpa.GELU_P, gdpa.GELU_S
    gdpa.GELU_CLAMP, gdpa.GELU_P, gdpa.GELU_S = c, p32, s32
    try:
        xs = torch.linspace(-12, 12, 960001, dtype=torch.float64)
        ev, eg = exact(xs)
        gv, gg = gdpa.gelu_poly_reference(xs.float())
    finally:
        gdpa.GELU_CLAMP, gdpa.GELU_P, gdpa.GELU_S = saved
    print(f"clamp {c}: value max abs err {(gv.double() - ev).abs().max():.3e}, "
          f"gradient max abs err {(gg.double() - eg).abs().max():.3e}")
    print("GELU_P =", "(" + ", ".join(f"{a:.9e}" for a in p32) + ")")
    print("GELU_S =", "(" + ", ".join(f"{a:.9e}" for a in s32) + ")")


if __name__ == "__main__":
    main()
