r"""FP8 (E4M3) linear layers and MLP block on Hopper tensor cores, with an emulated twin.

The ``fp8`` precision format runs every GEMM of a Linear (forward, dgrad, wgrad) on E4M3
operands quantized along that GEMM's contraction axis with power-of-two (E8M0) scales under the
RCEIL rule (no element saturates). ``precision.fp8.granularity`` picks how many values share a
scale:

- ``row``: one scale per row of each operand over the whole contraction, applied in the GEMM
  epilogue (gemctl.ops.triton.fp8_gemm): the fast format on Hopper;
- ``block128``: one scale per 128 contraction values on both operands (DeepSeek-V3's activation
  granularity), applied per K-block inside the GEMM loop;
- ``mx32``: the MX granularity (32 values, OCP v1.0 with E4M3 and RCEIL): MX numerics on real
  FP8 tensor cores (Hopper has no block-scaled MMA, so each 32-deep K-block is scaled by hand).

Operands by GEMM, for y = x W^T with x [T, K] (T tokens), W [N, K], gy [T, N]:

    forward  y  = x  W^T      contracts K: x along K,  W along K
    dgrad    dx = gy W        contracts N: gy along N, W along N (the operand is W^T [K, N])
    wgrad    dW = gy^T x      contracts T: gy and x along the tokens (operands gy^T, x^T)

For ``row``, the wgrad operands gy^T and x^T carry one scale per feature and chunk of
``token_chunk`` (4096) tokens, applied where the GEMM promotes its tensor-core partial sums to
float32 anyway: every cast then only reduces over rows it reads itself (a scale over the whole
batch would need a reduction pass first). The forward saves x^T and W^T in FP8 for the backward,
not the high-precision tensors. ``wgrad: bf16`` keeps the weight-gradient GEMM unquantized (saving
x in its own dtype instead), ``dgrad: bf16`` the input-gradient GEMM (saving W itself); both
together leave FP8 in the forward only, the ablation that tells the forward's quantization from
the backward's.

``hadamard = s`` (a power of two, 0: off) rotates both forward operands along their contraction
axis K by the same block-diagonal random Hadamard transform R = H_s D / sqrt(s) per s features
before they are quantized (QuaRot-style): R is orthogonal, so (x R)(W R)^T = x W^T, and autograd
through the rotation takes the gradients back (dx = dx' R^T, dW = dW' R^T); the backward GEMMs
quantize the rotated operands. A layer whose K is not a multiple of s runs unrotated (said once).
Measured on the emulated numerics (scripts/bench_fp8.py --only outliers, docs/precision.md): for
E4M3 with power-of-two scales it does not lower the GEMM's error, and it raises the error of the
small features next to outlier features: E4M3 is a floating-point format whose range already
holds both, and the rotation spreads each outlier's rounding error over its whole block.

``fp8_mlp(x, w_up, w_down)`` is the MLP block ``down(silu(up(x)))`` with the row-wise format
and fused producers: the casts of the pre-activation apply silu on the fly (silu(pre) never
exists in bf16 in memory), and the backward's first GEMM multiplies by silu'(pre) in its
epilogue, so dpre is written once, in bf16, and cast from there. With ``norm_weight`` the block's
pre-norm is fused too (``down(silu(up(RMSNorm(x))))``): the norm's output is quantized where it
is computed (fp8_rmsnorm_cast_rows) and recomputed from x and the rows' rstd by the column cast
of the weight-gradient operand, so it never exists in bf16 in memory either; the norm's backward
is one Triton pass over the dgrad GEMM's output (gemctl.ops.triton.rms_norm). (Amax reductions
folded into the GEMM epilogues were measured and dropped twice: with atomics the up-projection
fell from 990 to 648 TF/s on the H200; as per-tile E8M0 bytes of dpre, which let one read of
dpre give both its operands, the silu' dgrad GEMM went from 0.81-0.84 to 1.02-1.09 ms at d=1024
while the one-read cast saved 0.08 ms against the two reads.)

Off CUDA (and for any input the kernels do not take) the same numerics run emulated: quantize
and dequantize in float32 (gemctl.precision.mx.mx_qdq with the block set to the whole
contraction for ``row``) around a float32 GEMM; the trainer says so once.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gemctl.precision.mx import mx_qdq
from gemctl.precision.mx_linear import compute_dtype

GRANULARITIES = {"row": 0, "block128": 128, "mx32": 32}  # name -> values per scale (0: the whole row)
_said: set[str] = set()


@dataclass(frozen=True)
class Fp8Recipe:
    granularity: str = "row"
    wgrad: str = "fp8"  # fp8 | bf16 (the weight-gradient GEMM unquantized, in the compute dtype)
    dgrad: str = "fp8"  # fp8 | bf16 (the input-gradient GEMM unquantized, in the compute dtype)
    fused_mlp: bool = True  # row-wise MLP blocks through fp8_mlp (the fused producers)
    fused_qkv_norm: bool = True  # row-wise: the attention's pre-norm fused into the QKV projection's cast
    token_chunk: int = 4096  # row-wise: tokens per scale of the weight-gradient operands
    hadamard: int = 0  # features per block of the forward operands' Hadamard rotation (0: none)
    hadamard_seed: int = 0  # seed of the rotation's fixed sign vector

    @property
    def group(self) -> int:
        return GRANULARITIES[self.granularity]

    @property
    def wgrad_group(self) -> int:
        """Values per scale along the tokens in the weight-gradient GEMM."""
        return self.group or self.token_chunk

    @classmethod
    def from_config(cls, cfg) -> "Fp8Recipe":
        if cfg is None:
            return cls()
        return cls(granularity=str(cfg.granularity), wgrad=str(cfg.wgrad), dgrad=str(cfg.dgrad),
                   fused_mlp=bool(cfg.fused_mlp), fused_qkv_norm=bool(cfg.fused_qkv_norm),
                   token_chunk=int(cfg.token_chunk),
                   hadamard=int(cfg.hadamard), hadamard_seed=int(cfg.hadamard_seed))


def _say_once(key: str, message: str) -> None:
    if key not in _said:
        _said.add(key)
        print(f"gemctl.precision: {message}", file=sys.stderr)


@functools.lru_cache(maxsize=None)
def _has_fp8_tensor_cores(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def triton_ready(*tensors: torch.Tensor) -> bool:
    """The Triton FP8 kernels run here: CUDA tensors on an sm_89+ GPU (FP8 tensor cores), or the
    Triton interpreter (tests)."""
    from gemctl.ops.triton.common import INTERPRET

    if INTERPRET:
        return True
    if not all(t.is_cuda for t in tensors):
        return False
    return _has_fp8_tensor_cores(tensors[0].device)


# ------------------------------------------------------------------------------------------------
# Emulated numerics (the reference the kernels are tested against; the CPU path).


def qdq(t: torch.Tensor, group: int, axis: int) -> torch.Tensor:
    """E4M3 quantize-dequantize of ``t`` along ``axis`` in groups of ``group`` values (0: the whole
    axis), RCEIL power-of-two scales, float32 out."""
    block = max(t.shape[axis], 1) if group == 0 else group
    return mx_qdq(t, block=block, axis=axis, scale_rule="rceil", dtype=torch.float32)


class _EmulatedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, recipe: Fp8Recipe):
        g = recipe.group
        ctx.save_for_backward(x2d, weight)
        ctx.recipe = recipe
        return (qdq(x2d, g, 1) @ qdq(weight, g, 1).t()).to(compute_dtype(x2d, weight))

    @staticmethod
    def backward(ctx, gy):
        x2d, weight = ctx.saved_tensors
        recipe = ctx.recipe
        g = recipe.group
        dx = dw = None
        if ctx.needs_input_grad[0]:
            if recipe.dgrad == "bf16":
                dx = (gy.float() @ weight.float()).to(x2d.dtype)
            else:
                dx = (qdq(gy, g, 1) @ qdq(weight, g, 0)).to(x2d.dtype)
        if ctx.needs_input_grad[1]:
            if recipe.wgrad == "bf16":
                dw = gy.float().t() @ x2d.float()
            else:
                dw = qdq(gy, recipe.wgrad_group, 0).t() @ qdq(x2d, recipe.wgrad_group, 0)
            dw = dw.to(weight.dtype)
        return dx, dw, None



# ------------------------------------------------------------------------------------------------
# Triton path.


def _k_major(t: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 operand and scales of a K-major [R, K] tensor in groups of ``group`` along K (group
    granularities; K padded with zeros to a multiple of the group)."""
    from gemctl.ops.triton.mx_quant import mx_quantize

    pad = -t.shape[1] % group
    if pad:
        t = F.pad(t, (0, pad))
    return mx_quantize(t.contiguous(), block=group, scale_rule="rceil")


def _gemm(a, b, sa, sb, group: int, out_dtype: torch.dtype):
    from gemctl.ops.triton.fp8_gemm import fp8_gemm

    return fp8_gemm(a, b, sa, sb, group_k=group, out_dtype=out_dtype)


def _rows(t: torch.Tensor, act=None, chunk: int = 0):
    """(data, scales, column maxima): the row-wise operand and, when ``chunk`` (the token chunk of
    a column cast of ``t`` to come) allows, the column maxima that spare that cast its amax sweep;
    else None."""
    from gemctl.ops.triton.fp8_gemm import fp8_cast_rows

    col = _column_maxima(t, chunk)
    return fp8_cast_rows(t, act=act, **col) if col else (*fp8_cast_rows(t, act=act), None)


def _norm_rows(t: torch.Tensor, weight: torch.Tensor, eps: float, chunk: int = 0):
    """(data, scales, rstd, column maxima) of RMSNorm(t) as the row-wise operand (see _rows)."""
    from gemctl.ops.triton.fp8_gemm import fp8_rmsnorm_cast_rows

    col = _column_maxima(t, chunk)
    return fp8_rmsnorm_cast_rows(t, weight, eps, **col) if col else (*fp8_rmsnorm_cast_rows(t, weight, eps), None)


def _column_maxima(t: torch.Tensor, chunk: int) -> dict:
    """The row casts' column-maxima arguments for a column cast of t in chunks of ``chunk`` rows
    to come ({} when none: no chunk, or amax_rows_for finds no run length)."""
    from gemctl.ops.triton.fp8_gemm import amax_rows_for

    amax_rows = amax_rows_for(chunk, t.shape[0]) if chunk else 0
    return {"col_amax": True, "amax_rows": amax_rows} if amax_rows else {}


def _cols(t: torch.Tensor, chunk: int, act=None, part=None, norm=None):
    """Transposed operand with scales per column and chunk of ``chunk`` rows (``part``: the column
    bytes from ``_rows(t, act, chunk)``, whose run length fp8_cast_cols derives from chunk and the
    rows; ``norm=(rstd, weight)``: of RMSNorm(t), see _norm_rows)."""
    from gemctl.ops.triton.fp8_gemm import fp8_cast_cols

    return fp8_cast_cols(t, chunk, act=act, part=part, norm=norm)


def _rms_normed(x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm(x) from its rstd, as the fused kernels compute it (float32, rounded to x's dtype).
    x times the float32 rstd promotes to float32 in one pass: no float32 copy of x first."""
    return (torch.mul(x, rstd[:, None]) * weight.to(x.dtype).float()).to(x.dtype)


def _rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
                       need_dw: bool = True):
    """(dx, dweight) of y = x * rstd * w (w = weight in x's dtype, as gemctl.model.norm applies it;
    dweight None unless need_dw): one Triton pass where the FP8 kernels run (dy and x read once;
    torch's fused RMSNorm backward took 0.34 ms at [65536, 1024] on the H200, most of it in the
    weight-gradient reduction, the Triton pass 0.11 ms), torch's fused RMSNorm backward on other
    CUDA devices, the same math in float32 elsewhere."""
    from gemctl.ops.triton import rms_norm

    if triton_ready(x) and rms_norm.fits(x):
        return rms_norm.rms_norm_backward(dy, x, rstd, weight, need_dw)
    w = weight.to(x.dtype)
    if x.is_cuda and "rms_backward_missing" not in _said:
        try:
            dx, dw = torch.ops.aten._fused_rms_norm_backward(dy, x, [x.shape[-1]], rstd.view(-1, 1), w,
                                                             [True, need_dw])
            return dx, dw.to(weight.dtype) if need_dw else None
        except (AttributeError, NotImplementedError, RuntimeError) as exc:
            _say_once("rms_backward_missing", f"torch has no fused RMSNorm backward here ({type(exc).__name__}); "
                      "the fused FP8 MLP's norm backward runs as separate float32 ops")
    xhat = x.float() * rstd[:, None]
    g = dy.float() * w.float()
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), (dy.float() * xhat).sum(0).to(weight.dtype) if need_dw else None


def _transposed(w: torch.Tensor):
    """W^T as a row-wise operand (one scale per column of W over all its rows): a transposed copy
    cast by the row kernel, whose programs split over the rows of W^T; the column kernel with one
    chunk gives the same bytes but only cols / BLOCK_C programs for a whole weight."""
    return _rows(w.t())[:2]


class _Fp8LinearFunction(torch.autograd.Function):
    """y = x W^T, or with ``norm_w`` (row-wise only) y = RMSNorm(x) W^T with the norm fused into the
    operand's cast: RMSNorm(x) is quantized where it is computed and recomputed from x and the
    rows' rstd by the weight-gradient operand's column cast, never stored in bf16 (as fp8_mlp does
    for the MLP's pre-norm); the backward ends in the norm's backward."""

    @staticmethod
    def forward(ctx, x2d, weight, recipe: Fp8Recipe, norm_w=None, eps: float = 0.0):
        g = recipe.group
        out_dtype = compute_dtype(x2d, weight)
        # dx also when only the fused norm's weight needs a gradient (it flows through the norm)
        need_dx = ctx.needs_input_grad[0] or (norm_w is not None and ctx.needs_input_grad[3])
        need_dw = ctx.needs_input_grad[1]
        wgrad_fp8 = need_dw and recipe.wgrad == "fp8"
        dgrad_fp8 = need_dx and recipe.dgrad == "fp8"
        saved = (None, None, None, None)
        rstd = None
        if g == 0:
            chunk = wgrad_fp8 and recipe.token_chunk
            if norm_w is not None:
                xr, xs, rstd, xp = _norm_rows(x2d, norm_w, eps, chunk=chunk)
            else:
                xr, xs, xp = _rows(x2d, chunk=chunk)
            wr, ws, _ = _rows(weight)
            y = _gemm(xr, wr, xs, ws, 0, out_dtype)
            norm = (rstd, norm_w) if norm_w is not None else None
            saved = (*(_cols(x2d, recipe.token_chunk, part=xp, norm=norm) if wgrad_fp8 else (None, None)),
                     *(_transposed(weight) if dgrad_fp8 else (None, None)))  # x^T for the wgrad, W^T for the dgrad
        else:
            if norm_w is not None:
                raise ValueError("fp8_linear: a fused pre-norm needs the row-wise granularity")
            a, sa = _k_major(x2d, g)
            b, sb = _k_major(weight, g)
            y = _gemm(a, b, sa, sb, g, out_dtype)
        ctx.recipe, ctx.need_dx = recipe, need_dx
        ctx.x_dtype, ctx.w_dtype, ctx.out_dtype = x2d.dtype, weight.dtype, out_dtype
        keep_x = ((g or not wgrad_fp8) and need_dw) or (norm_w is not None and need_dx)  # the norm's backward reads x
        ctx.save_for_backward(x2d if keep_x else None, weight if need_dx and (g or not dgrad_fp8) else None, *saved,
                              rstd, norm_w)
        return y

    @staticmethod
    def backward(ctx, gy):
        x2d, weight, xt, xcs, wt, wcs, rstd, norm_w = ctx.saved_tensors
        recipe = ctx.recipe
        g = recipe.group
        need_dx, need_dw = ctx.need_dx, ctx.needs_input_grad[1]
        wgrad_fp8 = need_dw and recipe.wgrad == "fp8"
        dgrad_fp8 = need_dx and recipe.dgrad == "fp8"
        dx = dw = None
        gy = gy.contiguous()
        if g == 0:
            gp = None
            if dgrad_fp8:
                gr, gs, gp = _rows(gy, chunk=wgrad_fp8 and recipe.token_chunk)
                dx = _gemm(gr, wt, gs, wcs, 0, ctx.x_dtype)
            if wgrad_fp8:
                gt, gcs = _cols(gy, recipe.token_chunk, part=gp)
                dw = _gemm(gt, xt, gcs, xcs, recipe.token_chunk, ctx.w_dtype)
        else:
            if dgrad_fp8:
                a, sa = _k_major(gy, g)
                b, sb = _k_major(weight.t(), g)
                dx = _gemm(a, b, sa, sb, g, ctx.x_dtype)
            if wgrad_fp8:
                a, sa = _k_major(gy.t(), g)
                b, sb = _k_major(x2d.t(), g)
                dw = _gemm(a, b, sa, sb, g, ctx.w_dtype)
        # The unquantized gradient GEMMs, in the compute dtype (bf16 under autocast).
        if need_dx and not dgrad_fp8:
            dx = (gy.to(ctx.out_dtype) @ weight.to(ctx.out_dtype)).to(ctx.x_dtype)
        if need_dw and not wgrad_fp8:
            xn = x2d if norm_w is None else _rms_normed(x2d, rstd, norm_w)
            dw = (gy.to(ctx.out_dtype).t() @ xn.to(ctx.out_dtype)).to(ctx.w_dtype)
        dnorm = None
        if norm_w is not None and need_dx:  # dx is the gradient of the norm's output so far
            dx, dnorm = _rms_norm_backward(dx, x2d, rstd, norm_w, ctx.needs_input_grad[3])
        return (dx, dw, None) if norm_w is None else (dx, dw, None, dnorm, None)


@functools.lru_cache(maxsize=None)
def _signed_hadamard(size: int, seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """mx_linear.signed_hadamard on ``device`` in ``dtype`` (outside inference mode, see there)."""
    from gemctl.precision.mx_linear import signed_hadamard

    with torch.inference_mode(False):
        return signed_hadamard(size, seed).to(device, dtype)


def hadamard_features(t: torch.Tensor, size: int, seed: int = 0) -> torch.Tensor:
    """``t`` [..., K] rotated along K by the block-diagonal R = H_size D / sqrt(size) (orthogonal;
    K a multiple of size), in t's dtype; differentiable. The +-1 matrix multiplies first and the
    result is scaled by 1/sqrt(size) after: R itself in bf16 would round 1/sqrt(size) (for odd
    powers of two) and scale every rotated GEMM by a systematic -2e-4."""
    k = t.shape[-1]
    h = _signed_hadamard(size, seed, t.device, t.dtype)
    return (t.reshape(*t.shape[:-1], k // size, size) @ h).reshape(t.shape) * size**-0.5


def _rotated(x2d: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe):
    """The forward operands with the recipe's Hadamard rotation along K applied (where K allows)."""
    size, k = recipe.hadamard, x2d.shape[1]
    if not size:
        return x2d, weight
    if k % size:
        _say_once(f"hadamard{k}", f"fp8 Hadamard rotation of {size} features skipped for a layer with K={k} "
                  f"(not a multiple of {size})")
        return x2d, weight
    return hadamard_features(x2d, size, recipe.hadamard_seed), hadamard_features(weight, size, recipe.hadamard_seed)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Fp8Recipe,
               norm_weight: torch.Tensor | None = None, eps: float | None = None) -> torch.Tensor:
    """F.linear with FP8 GEMMs (forward and backward); x [..., K], weight [N, K]. ``norm_weight``
    [K]: ``F.linear(RMSNorm(x), ...)`` (see _pre_norm), the norm fused into the operand's casts
    where the kernels allow it (row-wise, Triton, no rotation), else applied first."""
    fusable = norm_weight is not None and recipe.group == 0 and not recipe.hadamard and triton_ready(x, weight)
    x, norm_weight, eps = _pre_norm(x, norm_weight, eps, fusable)
    if norm_weight is not None:
        y = _Fp8LinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, recipe, norm_weight, eps)
    else:
        x2d, w = _rotated(x.reshape(-1, x.shape[-1]), weight, recipe)
        if triton_ready(x2d, w) and _group_fits(recipe.group, x2d.shape[1], w.shape[0]):
            y = _Fp8LinearFunction.apply(x2d, w, recipe)
        else:
            _say_once("emulated", "fp8 GEMMs emulated (quantize-dequantize + float32 GEMM): the Triton FP8 kernels "
                      "need a CUDA GPU with FP8 tensor cores (sm_89+)" + (
                          f" and dimensions divisible by {recipe.group}" if recipe.group else ""))
            y = _EmulatedFunction.apply(x2d, w, recipe)
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias.to(y.dtype)


def _pre_norm(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float | None, fusable: bool):
    """``(x, norm_weight, eps)`` for a block whose pre-norm (gemctl.model.norm's RMSNorm: weight in
    x's dtype; eps None is x's dtype's machine epsilon, as torch's rms_norm takes it) may fuse into
    its first cast: unchanged where ``fusable`` and the rows fit the fused cast (8192 values), else
    x normalized here and no norm left to fuse."""
    from gemctl.ops.triton.fp8_gemm import _ROWS_IN_REGISTERS

    eps = torch.finfo(x.dtype).eps if eps is None else float(eps)
    if norm_weight is not None and not (fusable and x.shape[-1] <= _ROWS_IN_REGISTERS):
        x, norm_weight = F.rms_norm(x, (x.shape[-1],), norm_weight.to(x.dtype), eps), None
    return x, norm_weight, eps


def _group_fits(group: int, k: int, n: int) -> bool:
    return group == 0 or (k % group == 0 and n % group == 0)


def triton_gemms(recipe: Fp8Recipe, in_features: int, out_features: int, device: torch.device) -> bool:
    """A Linear of this shape under ``recipe`` runs its GEMMs as Triton kernels on ``device`` (as
    fp8_linear and fp8_mlp decide per call), rather than emulated through torch's matmul."""
    from gemctl.ops.triton.common import INTERPRET

    ready = INTERPRET or (device.type == "cuda" and _has_fp8_tensor_cores(device))
    return ready and _group_fits(recipe.group, in_features, out_features)


# ------------------------------------------------------------------------------------------------
# The MLP block down(silu(up(x))), row-wise, fused producers.


class _Fp8MLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, w_up, w_down, recipe: Fp8Recipe, norm_w=None, eps: float = 0.0):
        from gemctl.ops.triton.fp8_gemm import fp8_gemm

        out_dtype = compute_dtype(x2d, w_up)
        fp8_wgrad = recipe.wgrad == "fp8"
        chunk = fp8_wgrad and recipe.token_chunk
        rstd = None
        if norm_w is not None:  # the pre-norm's output quantized where it is computed
            xr, xs, rstd, xp = _norm_rows(x2d, norm_w, eps, chunk=chunk)
        else:
            xr, xs, xp = _rows(x2d, chunk=chunk)
        ur, us, _ = _rows(w_up)
        dr, ds, _ = _rows(w_down)
        pre = fp8_gemm(xr, ur, xs, us)
        # silu(pre) quantized on the fly (never stored in bf16); its column maxima kept for the
        # backward's column cast of silu(pre)
        hr, hs, hp = _rows(pre, act="silu", chunk=chunk)
        y = fp8_gemm(hr, dr, hs, ds, out_dtype=out_dtype)
        ctx.recipe = recipe
        ctx.dtypes = (x2d.dtype, w_up.dtype, w_down.dtype, out_dtype)
        norm = (rstd, norm_w) if norm_w is not None else None
        x_saved = _cols(x2d, recipe.token_chunk, part=xp, norm=norm) if fp8_wgrad else (x2d, None)
        # W^T operands for the FP8 dgrad GEMMs, or the weights themselves for unquantized ones
        w_saved = ((*_transposed(w_up), *_transposed(w_down)) if recipe.dgrad == "fp8"
                   else (w_up, None, w_down, None))
        # the norm's backward needs x, its rstd and weight
        norm_saved = (x2d, rstd, norm_w) if norm_w is not None else (None, None, None)
        ctx.save_for_backward(pre, *w_saved, *x_saved, hp, *norm_saved)
        return y

    @staticmethod
    def backward(ctx, gy):
        from gemctl.ops.triton.fp8_gemm import fp8_gemm

        pre, ut, ucs, dt, dcs, xt, xcs, hp, x_in, rstd, norm_w = ctx.saved_tensors
        x_dtype, up_dtype, down_dtype, cdt = ctx.dtypes
        recipe = ctx.recipe
        chunk = recipe.token_chunk
        fp8_wgrad = recipe.wgrad == "fp8"
        gy = gy.contiguous()
        if recipe.dgrad == "fp8":
            gr, gs, gp = _rows(gy, chunk=fp8_wgrad and chunk)
            dpre = fp8_gemm(gr, dt, gs, dcs, epilogue="silu_bwd", pre=pre)
            pr, ps, pp = _rows(dpre, chunk=fp8_wgrad and chunk)
            dx = fp8_gemm(pr, ut, ps, ucs, out_dtype=x_dtype)
        else:  # ut, dt hold the weights: unquantized GEMMs in the compute dtype; dpre in bf16 as above
            gp = pp = None
            p = pre.float()
            sig = torch.sigmoid(p)
            dpre = ((gy.to(cdt) @ dt.to(cdt)).float() * sig * (1 + p * (1 - sig))).to(pre.dtype)
            dx = (dpre.to(cdt) @ ut.to(cdt)).to(x_dtype)
        if fp8_wgrad:
            gt, gcs = _cols(gy, chunk, part=gp)
            ht, hcs = _cols(pre, chunk, act="silu", part=hp)
            dw_down = fp8_gemm(gt, ht, gcs, hcs, group_k=chunk, out_dtype=down_dtype)
            pt, pcs = _cols(dpre, chunk, part=pp)
            dw_up = fp8_gemm(pt, xt, pcs, xcs, group_k=chunk, out_dtype=up_dtype)
        else:  # xt holds x in its own dtype; the GEMMs in the compute dtype (bf16 under autocast)
            # torch's silu computes a bf16 input in float32 and rounds once: the same values as
            # silu(pre.float()).to(bf16) in one pass over pre instead of three
            h = F.silu(pre) if pre.dtype == cdt else F.silu(pre.float()).to(cdt)
            dw_down = (gy.to(cdt).t() @ h).to(down_dtype)
            xn = xt if norm_w is None else _rms_normed(xt, rstd, norm_w)
            dw_up = (dpre.to(cdt).t() @ xn.to(cdt)).to(up_dtype)
        dnorm = None
        if norm_w is not None:  # dx is the gradient of the norm's output so far
            dx, dnorm = _rms_norm_backward(dx, x_in, rstd, norm_w, ctx.needs_input_grad[4])
        return dx, dw_up, dw_down, None, dnorm, None


def fp8_mlp(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, recipe: Fp8Recipe,
            norm_weight: torch.Tensor | None = None, eps: float | None = None) -> torch.Tensor:
    """``down(silu(up(x)))`` with row-wise FP8 GEMMs and fused producers; x [..., d],
    w_up [hidden, d], w_down [d, hidden]. ``norm_weight`` [d]: the block's pre-norm too,
    ``down(silu(up(RMSNorm(x))))`` (gemctl.model.norm's RMSNorm: weight applied in x's dtype; eps
    None is x's dtype's machine epsilon, as torch's rms_norm takes it). Other granularities (or
    no Triton) run the norm, then the two linears of ``fp8_linear`` with silu between them."""
    # The fused producers apply the norm and silu inside the casts, before a rotation could: with
    # a Hadamard rotation the block runs as two fp8_linear calls (said once).
    fused = recipe.group == 0 and recipe.fused_mlp and triton_ready(x, w_up, w_down)
    if fused and recipe.hadamard:
        _say_once("hadamard_mlp", "fp8 MLP blocks with a Hadamard rotation run unfused (two fp8 linears)")
        fused = False
    x, norm_weight, eps = _pre_norm(x, norm_weight, eps, fused)
    if fused:
        y = _Fp8MLPFunction.apply(x.reshape(-1, x.shape[-1]), w_up, w_down, recipe, norm_weight, eps)
        return y.reshape(*x.shape[:-1], w_down.shape[0])
    return fp8_linear(F.silu(fp8_linear(x, w_up, None, recipe)), w_down, None, recipe)


def use_fp8_linear(module: nn.Linear, recipe: Fp8Recipe, norm: nn.Module | None = None) -> None:
    """Route an nn.Linear's forward through fp8_linear (parameters, state dicts and FSDP units
    unchanged). ``norm``: the RMSNorm (with a weight) in front of it, fused: the Linear then takes
    the norm's input, and the caller passes it un-normalized."""

    def forward(x):
        if norm is None:
            return fp8_linear(x, module.weight, module.bias, recipe)
        return fp8_linear(x, module.weight, module.bias, recipe, norm_weight=norm.weight, eps=norm.eps)

    module.forward = forward
    module.fp8_recipe = recipe
    module.norm_fused = norm is not None


def use_fp8_mlp(mlp: nn.Module, recipe: Fp8Recipe, norm: nn.Module | None = None) -> None:
    """Route an MLP (``up`` -> SiLU -> ``down``, no biases) through fp8_mlp. ``norm``: the block's
    pre-norm (an RMSNorm with a weight), fused into the MLP: the MLP then takes the norm's input,
    and ``mlp.norm_fused`` tells the caller (gemctl.model.sequence) to pass it un-normalized."""
    def forward(x):
        if norm is None:
            return fp8_mlp(x, mlp.up.weight, mlp.down.weight, recipe)
        return fp8_mlp(x, mlp.up.weight, mlp.down.weight, recipe, norm_weight=norm.weight, eps=norm.eps)

    mlp.norm_fused = norm is not None
    mlp.forward = forward
    mlp.fp8_recipe = recipe
