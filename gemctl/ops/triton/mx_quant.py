r"""MX (OCP Microscaling v1.0) quantization in Triton: FP8 elements and E8M0 scales in one pass.

Three kernels, all bit-identical to the PyTorch reference ``gemctl.precision.mx.quantize_mx``
(scale rules, NaN/Inf/zero/subnormal handling and saturation are documented there):

- ``mx_quantize(x, block=32, elem, axis, scale_rule)``: one read of ``x`` (fp32/bf16/fp16), one
  write of the FP8 bytes and the uint8 scales. Blocks run along ``axis``: the last axis of any
  tensor (rows of the flattened leading dimensions), or axis 0 of a 2-D tensor (the token axis
  of a weight-gradient GEMM operand). Axis 0 of a tensor with contiguous rows has its own kernel
  (``_mx_quant_axis0_kernel``: each thread walks its columns down the block, so the block maxima
  need no cross-thread reduction); any other layout runs the row kernel on swapped strides.
  Partial last blocks are masked (the same as zero padding).
- ``rmsnorm_mx_quantize(x, weight, eps, ...)``: RMSNorm of each row of a 2-D ``x`` followed by MX
  quantization of the normalized row along the feature axis (the contraction axis of the QKV and
  MLP up-projections that consume it), the producer of a GEMM operand writing it directly in FP8:
  no separate quantize pass and no round trip of the normalized activation through HBM unless it
  is asked for (``return_normed=True``, for a residual or a non-MX consumer). The quantized values
  are those of the normalized row rounded to ``x``'s dtype, so ``quantize_mx(normed)`` of the
  kernel's own normalized output reproduces them bit for bit. Forward only (a training backward
  recomputes the norm in the autograd graph).

Element rounding: on a GPU the hardware conversion (``cvt.rn.satfinite`` on sm_89+) after an
explicit clamp to the element range; under TRITON_INTERPRET=1 (whose FP8 casts do not round to
nearest-even and do not saturate: seen with Triton 3.7) an integer implementation of
round-to-nearest-even on the float32 bit pattern. Both paths are selectable (``bit_cast``) so the
GPU tier checks that they agree.

Scales: amax is taken on the integer bit patterns of |x| (a float32 NaN pattern orders above the
infinity pattern, so NaN and Inf reach the exponent test without a separate isnan pass).

Tile configs: per kernel a candidate list (below); the GPU picks the fastest per shape bucket on
first use (gemctl.ops.triton.common.pick_config). scripts/bench_mx.py reports GB/s against the
copy bandwidth of the same run (docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemctl.ops.triton.common import INTERPRET, bucket_len, cdiv, next_pow2, pick_config

_ELEMS = {  # dtype -> (E5M2 flag, emax_elem, largest finite value)
    torch.float8_e4m3fn: (False, 8, 448.0),
    torch.float8_e5m2: (True, 15, 57344.0),
}
_RULES = ("floor", "rceil")
# (rows per program, MX blocks per program, warps). First entry: the untimed default
# (GEMCTL_AUTOTUNE=0). Row-major operands want several blocks per row; axis-0 operands (blocks
# down the columns) want many rows, which are then the contiguous direction.
_QUANT_CANDIDATES = [
    (32, 4, 4), (64, 4, 4), (16, 8, 4), (64, 2, 4), (128, 1, 4), (32, 8, 8), (8, 16, 4), (128, 2, 8), (256, 1, 8),
]
_QUANT_INTERPRET = (4, 2, 1)
# Axis-0 kernel: (columns per program, rows per slice, warps). Each thread reads 16 contiguous
# bf16 columns of a row (two 16-B loads). Slices shorter than the MX block: the block is read
# twice (maxima, then quantization; the second read hits cache), and columns per program >= 512 x
# warps keep each column's maximum inside one thread. A slice of the whole block: one read, the
# block in registers, reduced in-thread and by shuffles within a warp (one warp: 4 x 8 threads
# over 32 rows x 128 columns; more warps meet in shared memory).
_AXIS0_CANDIDATES = [(1024, 8, 2), (512, 8, 1), (4096, 8, 8), (2048, 8, 4), (128, 32, 1), (256, 32, 2), (256, 32, 1)]
_AXIS0_INTERPRET = (64, 8, 1)
# (rows per program, warps): every program holds whole rows (the norm needs the full row).
# One-warp programs reduce a row by shuffles alone (more warps per row meet in shared memory).
_NORM_CANDIDATES = [(4, 4), (1, 4), (2, 4), (4, 8), (8, 8), (16, 8), (2, 8), (1, 1), (1, 2)]
_NORM_INTERPRET = (2, 1)


@triton.jit
def _shared_exponent(amax_bits, EMAX: tl.constexpr, RCEIL: tl.constexpr):
    """Unbiased shared exponent in [-127, 127] from |amax|'s float32 bits (int32)."""
    shared = (amax_bits >> 23) - 127 - EMAX
    if RCEIL:  # round up when amax's significand exceeds 1.75, the element maximum's
        shared += ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return tl.minimum(tl.maximum(shared, -127), 127)


@triton.jit
def _fp8_bits(q, E5M2: tl.constexpr, BIT_CAST: tl.constexpr):
    """FP8 byte of float32 ``q``, round to nearest even. BIT_CAST (integer rounding): q finite and
    already clamped to the element range. The hardware conversion (cvt.rn.satfinite) saturates by
    itself and gives a NaN the byte 0x7F."""
    if not BIT_CAST:
        if E5M2:
            return q.to(tl.float8e5).to(tl.uint8, bitcast=True)
        return q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    if E5M2:
        MBITS: tl.constexpr = 2
        REBIAS: tl.constexpr = (127 - 15) << 2
        MIN_NORMAL: tl.constexpr = 6.103515625e-05  # 2^-14
        SUB_UNITS: tl.constexpr = 65536.0  # 1 / 2^-16, the subnormal spacing
    else:
        MBITS: tl.constexpr = 3
        REBIAS: tl.constexpr = (127 - 7) << 3
        MIN_NORMAL: tl.constexpr = 0.015625  # 2^-6
        SUB_UNITS: tl.constexpr = 512.0  # 1 / 2^-9
    DROP: tl.constexpr = 23 - MBITS
    bits = q.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal range: round the float32 pattern to MBITS mantissa bits (ties to even), rebias.
    normal = ((mag + ((1 << (DROP - 1)) - 1) + ((mag >> DROP) & 1)) >> DROP) - REBIAS
    # Subnormal range: multiples of the subnormal spacing; adding 2^23 rounds to an integer
    # (ties to even) in float32, exact for the values below 2^3 that reach it (larger values are
    # clamped first: they take the normal branch, and must not overflow the int32 conversion).
    a = mag.to(tl.float32, bitcast=True)
    sub = ((tl.minimum(a, MIN_NORMAL) * SUB_UNITS + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a >= MIN_NORMAL, normal, sub)
    return (code | sign).to(tl.uint8)


@triton.jit
def _load_f32(ptrs, mask, IN_BF16: tl.constexpr):
    """float32 values at ptrs; IN_BF16: ptrs hold bf16 bit patterns as int16, widened exactly by a
    shift (the interpreter's bf16 conversion flushes bf16 subnormals to zero: Triton 3.7)."""
    if IN_BF16:
        raw = tl.load(ptrs, mask=mask, other=0)
        return (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _block_scales(amax_bits, EMAX: tl.constexpr, RCEIL: tl.constexpr):
    """Per-block (E8M0 byte, 2^-shared as float32, NaN/Inf flag) from |x|'s largest float32 bits."""
    shared = _shared_exponent(amax_bits, EMAX, RCEIL)
    nan = (amax_bits >> 23) == 255  # a NaN or an infinity in the block
    scale = tl.where(nan, 255, shared + 127).to(tl.uint8)
    inv = ((127 - shared) << 23).to(tl.float32, bitcast=True)  # 2^-shared, exact
    return scale, inv, nan


@triton.jit
def _quantize_elems(x, inv, nan, ELEM_MAX: tl.constexpr, E5M2: tl.constexpr, BIT_CAST: tl.constexpr):
    """FP8 bytes of float32 ``x`` scaled by ``inv``; ``inv`` and ``nan`` broadcast against x."""
    if not BIT_CAST:
        # cvt.rn.satfinite saturates by itself (the same as clamping first) and converts a NaN to
        # the canonical NaN byte 0x7F (E4M3 and E5M2 alike), which the spec gives every element of a
        # NaN-scaled block: a NaN factor for those blocks (per block, not per element) makes every
        # product NaN. Selecting 0x7F per element instead unpacked the converter's byte pairs (sm_90
        # SASS: a shift, a select and a byte permute per element on top of the conversion).
        return _fp8_bits(x * tl.where(nan, float("nan"), inv), E5M2, BIT_CAST)
    # the integer rounding needs finite values in the element range
    q = tl.where(nan, 0.0, x * inv)
    q = tl.minimum(tl.maximum(q, -ELEM_MAX), ELEM_MAX)
    return tl.where(nan, 0x7F, _fp8_bits(q, E5M2, BIT_CAST)).to(tl.uint8)  # the spec: a NaN scale makes the block NaN


@triton.jit
def _quantize_tile(x, EMAX: tl.constexpr, ELEM_MAX: tl.constexpr, E5M2: tl.constexpr, RCEIL: tl.constexpr,
                   BIT_CAST: tl.constexpr):
    """x: float32 (rows, blocks, BLOCK) -> (FP8 bytes of the same shape, E8M0 bytes (rows, blocks))."""
    scale, inv, nan = _block_scales(tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2), EMAX, RCEIL)
    return _quantize_elems(x, inv[:, :, None], nan[:, :, None], ELEM_MAX, E5M2, BIT_CAST), scale


@triton.jit(do_not_specialize=["rows"])  # per-batch sizes: common.py, "Specialization"
def _mx_quant_axis0_kernel(
    X,  # [rows, cols] input with unit stride along cols (stride_x between rows; bf16 as int16)
    DATA,  # [rows, cols] uint8 FP8 bytes (stride_d)
    SCALE,  # [ceil(rows / BLOCK), cols] uint8 E8M0 bytes (stride_s)
    rows, cols, stride_x, stride_d, stride_s,
    EMAX: tl.constexpr, ELEM_MAX: tl.constexpr, E5M2: tl.constexpr, RCEIL: tl.constexpr, BIT_CAST: tl.constexpr,
    IN_BF16: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr, CHUNK: tl.constexpr,
):
    # program (pid_b, pid_c) -> the MX blocks of rows [pid_b*BLOCK, +BLOCK) x cols [pid_c*BLOCK_C, +BLOCK_C).
    # Blocks run down the columns. CHUNK >= BLOCK: the whole block is read once and held in
    # registers. CHUNK < BLOCK: the tile is walked twice in CHUNK-row slices (column maxima, then
    # the quantization; the second read comes from cache), each thread keeping its columns' maxima
    # in registers. Every access is a contiguous row run, and every vector is kept 2-D (1, BLOCK_C)
    # in the tile's own layout, so no value changes layout.
    pid_b = tl.program_id(0)
    pid_c = tl.program_id(1)
    c = (pid_c * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
    r0 = pid_b * BLOCK
    if CHUNK >= BLOCK:  # the whole block held in registers: one read
        r = (r0 + tl.arange(0, BLOCK))[:, None]
        mask = (r < rows) & (c < cols)
        x = _load_f32(X + r.to(tl.int64) * stride_x + c, mask, IN_BF16)
        scale, inv, nan = _block_scales(tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0, keep_dims=True),
                                        EMAX, RCEIL)
        tl.store(DATA + r.to(tl.int64) * stride_d + c, _quantize_elems(x, inv, nan, ELEM_MAX, E5M2, BIT_CAST), mask=mask)
    else:
        amax = tl.zeros([1, BLOCK_C], dtype=tl.int32)
        for i in tl.static_range(0, BLOCK, CHUNK):
            r = (r0 + i + tl.arange(0, CHUNK))[:, None]
            mask = (r < rows) & (c < cols)
            if IN_BF16:  # bf16 magnitudes order like their bit patterns; widen once per column at the end
                raw = tl.load(X + r.to(tl.int64) * stride_x + c, mask=mask, other=0)
                amax = tl.maximum(amax, tl.max(raw.to(tl.int32) & 0x7FFF, axis=0, keep_dims=True))
            else:
                xf = tl.load(X + r.to(tl.int64) * stride_x + c, mask=mask, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.max(xf.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0, keep_dims=True))
        if IN_BF16:
            amax = amax << 16
        scale, inv, nan = _block_scales(amax, EMAX, RCEIL)
        for i in tl.static_range(0, BLOCK, CHUNK):
            r = (r0 + i + tl.arange(0, CHUNK))[:, None]
            mask = (r < rows) & (c < cols)
            x = _load_f32(X + r.to(tl.int64) * stride_x + c, mask, IN_BF16)
            tl.store(DATA + r.to(tl.int64) * stride_d + c, _quantize_elems(x, inv, nan, ELEM_MAX, E5M2, BIT_CAST),
                     mask=mask)
    tl.store(SCALE + pid_b.to(tl.int64) * stride_s + c, scale, mask=c < cols)


# rows: per batch where rows are tokens (do_not_specialize, common.py "Specialization"); cols stays
# specialized, its divisibility vectorizes the loads along the row (on the column-quantize path,
# strides swapped, cols is the token count and a new divisibility compiles again).
@triton.jit(do_not_specialize=["rows"])
def _mx_quant_kernel(
    X,  # input, rows x cols addressed by (stride_xr, stride_xc): blocks run along cols (bf16 as int16)
    DATA,  # uint8 FP8 bytes, same logical shape as X (strides stride_dr, stride_dc)
    SCALE,  # uint8 E8M0 bytes, rows x ceil(cols / BLOCK) (strides stride_sr, stride_sb)
    rows, cols, n_blocks,
    stride_xr, stride_xc, stride_dr, stride_dc, stride_sr, stride_sb,
    EMAX: tl.constexpr, ELEM_MAX: tl.constexpr, E5M2: tl.constexpr, RCEIL: tl.constexpr, BIT_CAST: tl.constexpr,
    IN_BF16: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCKS_C: tl.constexpr,
):
    # program (pid_r, pid_c) -> rows [pid_r*BLOCK_R, +BLOCK_R) x MX blocks [pid_c*BLOCKS_C, +BLOCKS_C)
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    b = pid_c * BLOCKS_C + tl.arange(0, BLOCKS_C)
    e = tl.arange(0, BLOCK)
    c = b[None, :, None] * BLOCK + e[None, None, :]  # (1, BLOCKS_C, BLOCK) column index
    r3 = r[:, None, None]
    mask = (r3 < rows) & (c < cols)
    x = _load_f32(X + r3.to(tl.int64) * stride_xr + c.to(tl.int64) * stride_xc, mask, IN_BF16)
    code, scale = _quantize_tile(x, EMAX, ELEM_MAX, E5M2, RCEIL, BIT_CAST)
    tl.store(DATA + r3.to(tl.int64) * stride_dr + c.to(tl.int64) * stride_dc, code, mask=mask)
    smask = (r[:, None] < rows) & (b[None, :] < n_blocks)
    tl.store(SCALE + r[:, None].to(tl.int64) * stride_sr + b[None, :].to(tl.int64) * stride_sb, scale, mask=smask)


@triton.jit(do_not_specialize=["rows"])  # per-batch sizes: common.py, "Specialization"
def _rmsnorm_mx_quant_kernel(
    X,  # [rows, cols] input rows (stride_xr; unit stride along cols; bf16 as int16)
    W,  # [cols] norm weight
    Y,  # [rows, cols] normalized output in X's dtype (stride_yr), written if WRITE_Y
    DATA,  # [rows, cols] uint8 FP8 bytes of the normalized rows (stride_dr)
    SCALE,  # [rows, n_blocks] uint8 E8M0 bytes (stride_sr)
    rows, cols, n_blocks, eps,
    stride_xr, stride_yr, stride_dr, stride_sr,
    WRITE_Y: tl.constexpr, HAS_W: tl.constexpr,
    EMAX: tl.constexpr, ELEM_MAX: tl.constexpr, E5M2: tl.constexpr, RCEIL: tl.constexpr, BIT_CAST: tl.constexpr,
    IN_BF16: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCKS_C: tl.constexpr,
):
    # program pid -> whole rows [pid*BLOCK_R, +BLOCK_R); BLOCKS_C * BLOCK >= cols
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    b = tl.arange(0, BLOCKS_C)
    c = b[None, :, None] * BLOCK + tl.arange(0, BLOCK)[None, None, :]  # (1, BLOCKS_C, BLOCK)
    r3 = r[:, None, None].to(tl.int64)
    mask = (r[:, None, None] < rows) & (c < cols)
    x = _load_f32(X + r3 * stride_xr + c, mask, IN_BF16)
    mean_sq = tl.sum(tl.sum(x * x, axis=2), axis=1) / cols  # (BLOCK_R,)
    rstd = 1.0 / tl.sqrt(mean_sq + eps)
    y = x * rstd[:, None, None]
    if HAS_W:
        y = y * tl.load(W + c, mask=c < cols, other=0.0).to(tl.float32)
    y = y.to(Y.dtype.element_ty)  # the activation as a non-fused norm would store it
    if WRITE_Y:
        tl.store(Y + r3 * stride_yr + c, y, mask=mask)
    code, scale = _quantize_tile(y.to(tl.float32), EMAX, ELEM_MAX, E5M2, RCEIL, BIT_CAST)
    tl.store(DATA + r3 * stride_dr + c, code, mask=mask)
    smask = (r[:, None] < rows) & (b[None, :] < n_blocks)
    tl.store(SCALE + r[:, None].to(tl.int64) * stride_sr + b[None, :], scale, mask=smask)


# ------------------------------------------------------------------------------------------------
# Host launchers.


def bf16_bits(t: torch.Tensor) -> torch.Tensor:
    """A bf16 tensor as its int16 bit patterns (same strides), any other unchanged: the kernels
    widen bf16 by a shift (IN_BF16), exact where the interpreter's bf16 conversion is not."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _elem_args(elem, scale_rule: str, block: int, bit_cast):
    if elem not in _ELEMS:
        raise ValueError(f"MX element dtype {elem} is not supported; allowed: torch.float8_e4m3fn, torch.float8_e5m2")
    if scale_rule not in _RULES:
        raise ValueError(f"scale_rule {scale_rule!r} is not allowed; allowed: {', '.join(_RULES)}")
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two (Triton tiles), got {block}")
    e5m2, emax, elem_max = _ELEMS[elem]
    return dict(EMAX=emax, ELEM_MAX=elem_max, E5M2=e5m2, RCEIL=scale_rule == "rceil",
                BIT_CAST=INTERPRET if bit_cast is None else bool(bit_cast), BLOCK=block)


def mx_quantize(x: torch.Tensor, block: int = 32, elem: torch.dtype = torch.float8_e4m3fn, *, axis: int = -1,
                scale_rule: str = "floor", bit_cast: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``quantize_mx``: ``(data in elem, scale uint8)``, same shapes and bytes.

    ``axis``: the last axis of any tensor, or axis 0 of a 2-D tensor. ``bit_cast``: None picks
    the hardware conversion on a GPU and the integer one under the interpreter.
    """
    consts = _elem_args(elem, scale_rule, block, bit_cast)
    if not x.is_floating_point() or x.dim() == 0:
        raise ValueError(f"mx_quantize: x must be a floating-point tensor with >= 1 dimension, got {x.dtype} {tuple(x.shape)}")
    axis = axis % x.dim()
    data = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    if axis == x.dim() - 1:
        x2 = x.reshape(-1, x.shape[-1])
        d2 = data.view(-1, x.shape[-1])
        rows, cols = x2.shape
        scale = torch.empty((*x.shape[:-1], cdiv(cols, block)), dtype=torch.uint8, device=x.device)
        s2 = scale.view(rows, -1)
        strides = (x2.stride(0), x2.stride(1), d2.stride(0), d2.stride(1), s2.stride(0), s2.stride(1))
    elif axis == 0 and x.dim() == 2 and (x.stride(1) == 1 or x.shape[1] == 1) and x.numel():
        return _mx_quantize_axis0(x, consts, elem)
    elif axis == 0 and x.dim() == 2:  # columns not contiguous: the row kernel on swapped strides
        cols, rows = x.shape  # kernel rows = x's columns; blocks run down x's rows
        scale = torch.empty((cdiv(cols, block), rows), dtype=torch.uint8, device=x.device)
        strides = (x.stride(1), x.stride(0), data.stride(1), data.stride(0), scale.stride(1), scale.stride(0))
    else:
        raise ValueError(f"mx_quantize: blocks along axis {axis} of a {x.dim()}-d tensor are not supported; "
                         "use the last axis, or axis 0 of a 2-D tensor")
    n_blocks = cdiv(cols, block)
    if x.numel() == 0:
        return data.view(elem), scale
    in_bf16 = x.dtype == torch.bfloat16
    xin = bf16_bits(x)

    def run(cfg):
        block_r, blocks_c, warps = cfg
        grid = (cdiv(rows, block_r), cdiv(n_blocks, blocks_c))
        _mx_quant_kernel[grid](xin, data, scale, rows, cols, n_blocks, *strides, BLOCK_R=block_r, BLOCKS_C=blocks_c,
                               IN_BF16=in_bf16, num_warps=warps, **consts)

    key = ("mx_quant", bucket_len(rows), bucket_len(cols), axis == 0, x.dtype, consts["E5M2"], consts["BIT_CAST"])
    run(pick_config(key, _QUANT_CANDIDATES, run, _QUANT_INTERPRET))
    return data.view(elem), scale


def _mx_quantize_axis0(x: torch.Tensor, consts: dict, elem: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks down the columns of a 2-D ``x`` whose rows are contiguous (the wgrad operands)."""
    rows, cols = x.shape
    block = consts["BLOCK"]
    data = torch.empty((rows, cols), dtype=torch.uint8, device=x.device)
    scale = torch.empty((cdiv(rows, block), cols), dtype=torch.uint8, device=x.device)
    in_bf16 = x.dtype == torch.bfloat16
    xin = bf16_bits(x)

    def run(cfg):
        block_c, chunk, warps = cfg
        grid = (cdiv(rows, block), cdiv(cols, block_c))
        _mx_quant_axis0_kernel[grid](xin, data, scale, rows, cols, x.stride(0),
                                     data.stride(0), scale.stride(0), BLOCK_C=block_c, CHUNK=min(chunk, block),
                                     IN_BF16=in_bf16, num_warps=warps, **consts)

    key = ("mx_quant_axis0", bucket_len(rows), bucket_len(cols), x.dtype, consts["E5M2"], consts["BIT_CAST"])
    run(pick_config(key, _AXIS0_CANDIDATES, run, _AXIS0_INTERPRET))
    return data.view(elem), scale


def rmsnorm_mx_quantize(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *, block: int = 32,
                        elem: torch.dtype = torch.float8_e4m3fn, scale_rule: str = "floor", return_normed: bool = False,
                        bit_cast: bool | None = None):
    """RMSNorm of the rows of ``x`` [rows, cols] (times ``weight``), MX-quantized along cols.

    Returns ``(data, scale)``, or ``(normed, data, scale)`` with ``return_normed``; ``normed`` is in
    x's dtype and ``(data, scale) == quantize_mx(normed)`` bit for bit.
    """
    consts = _elem_args(elem, scale_rule, block, bit_cast)
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"rmsnorm_mx_quantize: x must be a 2-D floating-point tensor, got {x.dtype} {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    if weight is not None and weight.shape != (cols,):
        raise ValueError(f"rmsnorm_mx_quantize: weight shape {tuple(weight.shape)} != ({cols},)")
    n_blocks = cdiv(cols, block)
    data = torch.empty((rows, cols), dtype=torch.uint8, device=x.device)
    scale = torch.empty((rows, n_blocks), dtype=torch.uint8, device=x.device)
    normed = torch.empty((rows, cols) if return_normed else (1, 1), dtype=x.dtype, device=x.device)
    if rows and cols:
        w = weight if weight is not None else x  # never read without HAS_W
        xin = bf16_bits(x)

        def run(cfg):
            block_r, warps = cfg
            _rmsnorm_mx_quant_kernel[(cdiv(rows, block_r),)](
                xin, w, normed, data, scale, rows, cols, n_blocks, eps,
                x.stride(0), normed.stride(0), data.stride(0), scale.stride(0),
                WRITE_Y=return_normed, HAS_W=weight is not None, IN_BF16=x.dtype == torch.bfloat16, BLOCK_R=block_r,
                BLOCKS_C=next_pow2(n_blocks), num_warps=warps, **consts)

        key = ("rmsnorm_mx", bucket_len(rows), cols, x.dtype, return_normed, consts["BIT_CAST"])
        run(pick_config(key, _NORM_CANDIDATES, run, _NORM_INTERPRET))
    if return_normed:
        return normed, data.view(elem), scale
    return data.view(elem), scale
