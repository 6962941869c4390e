r"""MX (OCP Microscaling Formats v1.0) block quantization: the PyTorch reference numerics.

A block of ``block`` (32) consecutive values along one axis shares one power-of-two scale X,
stored as an E8M0 byte (the biased exponent, bias 127: byte b means 2^(b - 127); 0xFF is NaN;
E8M0 has no zero and no infinity). Each element is stored as P_i = cast(V_i / X) in FP8 (E4M3 or
E5M2), so the block decodes to X * P_i.

Scale rules (``scale_rule``):

- ``"floor"`` (the spec's conversion, section 6.3): X = 2^(floor(log2(amax)) - emax_elem), with
  emax_elem = 8 for E4M3 (max 448 = 1.75 * 2^8) and 15 for E5M2 (max 57344 = 1.75 * 2^15). The
  largest element then lands in [256, 512) (E4M3); the part above the element maximum saturates.
- ``"rceil"`` (round up, as cuBLAS's MXFP8 block quantization and torchao's RCEIL mode):
  X = 2^ceil(log2(amax / elem_max)), so no element saturates. The exponent is computed exactly
  from amax's bits: floor(log2(amax)) - emax_elem, plus one when amax's significand exceeds 1.75
  (the element maximum's significand); there is no rounding of amax / elem_max in float32.

Special values and edge cases (both rules):

- amax is taken over |V_i| in float32 (bf16/fp16 inputs are widened exactly).
- A block whose amax is 0 (all zeros), or so small that the exponent falls below -127, gets the
  smallest scale 2^-127 (byte 0); zeros keep their sign (+0 -> 0x00, -0 -> 0x80).
- Subnormal inputs need no special case: their exponent is below -126, so their block's scale is
  clamped to 2^-127 unless a larger value shares the block; V_i / X is exact in float32 except
  where it is smaller than 2^-126, which is far below half the smallest FP8 subnormal (2^-10 for
  E4M3, 2^-17 for E5M2), so it rounds to a signed zero either way.
- A block holding a NaN or an infinity gets the NaN scale 0xFF (E8M0 has no infinity; the block
  decodes to NaN, as the spec makes a NaN scale mean). Its element bytes are written as 0x7F (a
  NaN code in both E4M3 and E5M2) so the output is deterministic.
- Elements: V_i / X (exact: X is a power of two) clamped to +-elem_max (saturating, so E5M2 never
  produces an infinity and E4M3 never a NaN from a finite input), then rounded to nearest, ties
  to even (``rounding="nearest"``), or stochastically between the two neighbouring FP8 values
  with probability proportional to proximity (``rounding="stochastic"``, for gradients).

Axis handling: blocks run along ``axis`` (the contraction axis of the GEMM that consumes the
operand). ``data`` has the shape of ``x``; ``scale`` (uint8) has the shape of ``x`` with ``axis``
shortened to ceil(size / block). A length that is not a multiple of ``block`` is accepted: the
last block is partial, which is the same as zero-padding the axis to a multiple of ``block``
(zeros never raise a block's amax) and dropping the padding from ``data``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

E8M0_BIAS = 127
E8M0_NAN = 0xFF
NAN_CODE = 0x7F  # element byte of a NaN-scale block: NaN in E4M3 (S.1111.111) and E5M2 (S.11111.11)
SCALE_RULES = ("floor", "rceil")
ROUNDINGS = ("nearest", "stochastic")


@dataclass(frozen=True)
class ElemFormat:
    name: str
    dtype: torch.dtype
    mbits: int  # stored mantissa bits
    emax: int  # exponent of the largest normal value (the spec's emax_elem)
    max: float  # largest finite value
    min_normal_exp: int  # exponent of the smallest normal value


ELEM_FORMATS = {
    torch.float8_e4m3fn: ElemFormat("e4m3", torch.float8_e4m3fn, 3, 8, 448.0, -6),
    torch.float8_e5m2: ElemFormat("e5m2", torch.float8_e5m2, 2, 15, 57344.0, -14),
}
ELEM_NAMES = {f.name: f.dtype for f in ELEM_FORMATS.values()}


def elem_format(elem) -> ElemFormat:
    """The element format of a dtype (torch.float8_e4m3fn, torch.float8_e5m2) or name (e4m3, e5m2)."""
    dtype = ELEM_NAMES.get(elem, elem) if isinstance(elem, str) else elem
    if dtype not in ELEM_FORMATS:
        raise ValueError(f"MX element format {elem!r} is not supported; allowed: e4m3, e5m2 "
                         "(torch.float8_e4m3fn, torch.float8_e5m2)")
    return ELEM_FORMATS[dtype]


def _check(x: torch.Tensor, block: int, scale_rule: str, axis: int) -> int:
    if not x.is_floating_point():
        raise TypeError(f"quantize_mx: x must be a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("quantize_mx: x must have at least one dimension")
    if block < 1:
        raise ValueError(f"quantize_mx: block must be >= 1, got {block}")
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"quantize_mx: scale_rule {scale_rule!r} is not allowed; allowed: {', '.join(SCALE_RULES)}")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"quantize_mx: axis {axis} is out of range for a {x.dim()}-d tensor")
    return axis % x.dim()


def _blocked(x: torch.Tensor, block: int, axis: int) -> tuple[torch.Tensor, int]:
    """float32 view [..., n_blocks, block] with ``axis`` last, zero-padded; and the axis length."""
    xt = x.movedim(axis, -1).float()
    size = xt.shape[-1]
    pad = -size % block
    if pad:
        xt = F.pad(xt, (0, pad))
    return xt.reshape(*xt.shape[:-1], -1, block), size


def _unblocked(t: torch.Tensor, size: int, axis: int) -> torch.Tensor:
    t = t.reshape(*t.shape[:-2], -1)[..., :size]
    return t.movedim(-1, axis)


def shared_exponents(amax_bits: torch.Tensor, fmt: ElemFormat, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Unbiased shared exponents in [-127, 127] and the NaN mask, from |amax|'s float32 bits."""
    amax_bits = amax_bits.to(torch.int32)
    biased = amax_bits >> 23  # 0 for zeros and float32 subnormals (clamped below anyway)
    shared = biased - 127 - fmt.emax
    if scale_rule == "rceil":
        # amax = m * 2^e with m in [1, 2): amax / (1.75 * 2^emax) > 2^(e - emax) iff m > 1.75.
        shared = shared + ((amax_bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return shared.clamp(-E8M0_BIAS, E8M0_BIAS), biased == 0xFF


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent as float32 for integer exponents in [-126, 127] (built from the bits, exact)."""
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def _stochastic_round(q: torch.Tensor, fmt: ElemFormat, generator=None) -> torch.Tensor:
    """|q| <= fmt.max rounded down or up to a neighbouring FP8 value, up with probability equal
    to the distance from the lower one in units of the spacing (unbiased in expectation)."""
    a = q.abs()
    _, exp = torch.frexp(a)  # a = m * 2^exp, m in [0.5, 1): floor(log2 a) = exp - 1
    spacing_exp = torch.clamp(exp - 1, min=fmt.min_normal_exp) - fmt.mbits
    t = torch.ldexp(a, -spacing_exp.to(a.dtype))  # exact: a power-of-two scaling
    low = torch.floor(t)
    u = torch.rand(q.shape, generator=generator, device=q.device, dtype=torch.float32)
    r = torch.ldexp(low + (u < t - low).to(t.dtype), spacing_exp.to(a.dtype))
    return torch.copysign(torch.clamp(r, max=fmt.max), q)


def quantize_mx(x: torch.Tensor, block: int = 32, elem=torch.float8_e4m3fn, *, axis: int = -1,
                scale_rule: str = "floor", rounding: str = "nearest", generator=None):
    """MX-quantize ``x`` in blocks of ``block`` values along ``axis``.

    Returns ``(data, scale)``: ``data`` in ``elem`` (torch.float8_e4m3fn or torch.float8_e5m2)
    with the shape of ``x``; ``scale`` uint8 E8M0 (biased exponent, 0xFF = NaN) with ``axis``
    shortened to ceil(size / block). The rules for zeros, subnormals, infinities, NaN and
    saturation are in the module docstring. ``rounding="stochastic"`` draws from ``generator``
    (default: the global generator of x's device).
    """
    axis = _check(x, block, scale_rule, axis)
    if rounding not in ROUNDINGS:
        raise ValueError(f"quantize_mx: rounding {rounding!r} is not allowed; allowed: {', '.join(ROUNDINGS)}")
    fmt = elem_format(elem)
    xb, size = _blocked(x, block, axis)  # (..., n_blocks, block) float32
    amax_bits = (xb.view(torch.int32) & 0x7FFFFFFF).amax(-1)  # NaN bit patterns order above inf
    shared, nan = shared_exponents(amax_bits, fmt, scale_rule)
    q = xb * _pow2(-shared).unsqueeze(-1)  # exact power-of-two scaling
    q = torch.where(nan.unsqueeze(-1), 0.0, q).clamp(-fmt.max, fmt.max)
    if rounding == "stochastic":
        q = _stochastic_round(q, fmt, generator)  # exactly representable: the cast below is exact
    codes = q.to(fmt.dtype).view(torch.uint8)
    codes = torch.where(nan.unsqueeze(-1), torch.tensor(NAN_CODE, dtype=torch.uint8, device=x.device), codes)
    scale = torch.where(nan, E8M0_NAN, shared + E8M0_BIAS).to(torch.uint8)
    data = _unblocked(codes, size, axis).contiguous().view(fmt.dtype)
    return data, scale.movedim(-1, axis).contiguous()


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8 or torch.float8_e8m0fnu) -> float32 2^(b - 127); 0xFF -> NaN; 0 -> 2^-127."""
    b = scale.view(torch.uint8).to(torch.int32)
    bits = torch.where(b == 0, 0x00400000, b << 23)  # 2^-127 is a float32 subnormal
    bits = torch.where(b == E8M0_NAN, 0x7FC00000, bits)
    return bits.view(torch.float32)


def dequantize_mx(data: torch.Tensor, scale: torch.Tensor, block: int = 32, *, axis: int = -1,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """X * P_i for every element, in ``dtype`` (computed in float32; a NaN scale gives NaN)."""
    axis = axis % data.dim()
    if data.dtype not in ELEM_FORMATS:
        raise TypeError(f"dequantize_mx: data must be float8_e4m3fn or float8_e5m2, got {data.dtype}")
    expected = list(data.shape)
    expected[axis] = -(-expected[axis] // block)
    if list(scale.shape) != expected:
        raise ValueError(f"dequantize_mx: scale shape {tuple(scale.shape)} does not match data {tuple(data.shape)} "
                         f"with block {block} along axis {axis} (expected {tuple(expected)})")
    vb, size = _blocked(data, block, axis)
    s = e8m0_to_float(scale.movedim(axis, -1).contiguous())
    return _unblocked(vb * s.unsqueeze(-1), size, axis).to(dtype)


def mx_qdq(x: torch.Tensor, block: int = 32, elem=torch.float8_e4m3fn, *, axis: int = -1,
           scale_rule: str = "floor", rounding: str = "nearest", dtype: torch.dtype | None = None,
           generator=None) -> torch.Tensor:
    """Quantize then dequantize (the values an MX GEMM would see), in ``dtype`` (default x.dtype).

    Exact in bf16 as well as float32 wherever the result is a normal number: an FP8 value times a
    power of two has at most 4 significant bits, within bf16's 8.
    """
    data, scale = quantize_mx(x, block, elem, axis=axis, scale_rule=scale_rule, rounding=rounding, generator=generator)
    return dequantize_mx(data, scale, block, axis=axis, dtype=dtype or x.dtype)
