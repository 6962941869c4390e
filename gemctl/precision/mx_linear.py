r"""MXFP8 linear layer, emulated: every GEMM operand is MX-quantized along that GEMM's contraction
axis, dequantized, and the GEMM runs in the compute dtype (bf16 under CUDA autocast, else the
input's dtype). The numerics are those of an MX block-scaled GEMM with exact products and a
higher-precision accumulator; the speed is not (three extra quantize passes per GEMM and no FP8
tensor-core use): this is the reference the fused Triton GEMMs are checked against.

For y = x W^T with x [N, K] (N tokens), W [M, K] and grad_y [N, M], the three GEMMs and the axis
each operand is blocked along:

    forward  y  = x  @ W^T   contracts K (in-features):  x along K (axis 1), W along K (axis 1)
    dgrad    dx = gy @ W     contracts M (out-features): gy along M (axis 1), W along M (axis 0)
    wgrad    dW = gy^T @ x   contracts N (tokens):       gy along N (axis 0), x along N (axis 0)

so W is quantized twice (once per blocking direction) and so is gy; the backward re-quantizes
the saved high-precision x and W (as torchao's emulated MX linear does). Forward operands use
``elem`` (E4M3 by default), the gradient gy uses ``grad_elem``.

Recipe options (``precision.mx`` in the config):

- ``wgrad_format: bf16`` keeps the weight-gradient GEMM unquantized (in the compute dtype).
- ``hadamard_wgrad``: before quantizing the wgrad operands, both gy and x are rotated along the
  token axis by the same block-diagonal random Hadamard transform R = H_32 D / sqrt(32) per 32
  tokens (H Sylvester-Hadamard, D a fixed +-1 sign vector drawn from ``hadamard_seed``), padding
  the tokens with zeros to a multiple of 32. R is orthogonal, so (R gy)^T (R x) = gy^T x exactly;
  an outlier token is spread over the 32 tokens of its MX block before they share one scale.
- ``stochastic_rounding``: the gradient gy is rounded stochastically (unbiased) in both backward
  GEMMs; weights and activations always round to nearest even.
- ``attention``: MXFP8 attention in the sequence tower's layers whose QKV projection is mxfp8:
  the operands of QK^T (q, k along the head dim) and of PV (the softmax probabilities and v along
  the keys) are MX-quantized in the forward (``mx_attention_quant``; gemctl.ops.jagged_attention's
  ``operand_quant``); the backward passes gradients straight through the quantization and runs
  on those quantized values. Emulated (no MX MMA on Hopper): on the PyTorch reference, or in the
  Triton jagged attention with backend "triton" (the probabilities quantized in-kernel).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gemctl.precision.mx import elem_format, mx_qdq

HADAMARD_SIZE = 32  # tokens per rotation block: one MX block along the token axis


@dataclass(frozen=True)
class MXRecipe:
    elem: torch.dtype = torch.float8_e4m3fn  # forward operands (x, W)
    grad_elem: torch.dtype = torch.float8_e4m3fn  # the output gradient in dgrad and wgrad
    block: int = 32
    scale_rule: str = "floor"  # floor (OCP spec) | rceil (round up, no saturation)
    wgrad_format: str = "mxfp8"  # mxfp8 | bf16 (the weight-gradient GEMM unquantized)
    hadamard_wgrad: bool = False
    hadamard_seed: int = 0
    stochastic_rounding: bool = False
    attention: bool = False  # MXFP8 QK^T and PV operands (full / window attention layers)

    @classmethod
    def from_config(cls, mx_cfg) -> "MXRecipe":
        """From a ``precision.mx`` config node (None: the defaults)."""
        if mx_cfg is None:
            return cls()
        return cls(
            elem=elem_format(str(mx_cfg.elem)).dtype,
            grad_elem=elem_format(str(mx_cfg.grad_elem)).dtype,
            scale_rule=str(mx_cfg.scale_rule),
            wgrad_format=str(mx_cfg.wgrad_format),
            hadamard_wgrad=bool(mx_cfg.hadamard_wgrad),
            hadamard_seed=int(mx_cfg.hadamard_seed),
            stochastic_rounding=bool(mx_cfg.stochastic_rounding),
            attention=bool(mx_cfg.attention),
        )


@functools.lru_cache(maxsize=None)
def signed_hadamard(size: int, seed: int) -> torch.Tensor:
    """H_size D in float32 on the CPU (size a power of two; H Sylvester-Hadamard, D a fixed +-1
    sign vector drawn from ``seed``): entries +-1, exact in any float dtype. Made outside inference
    mode, so a first call under torch.inference_mode() does not cache a tensor training cannot use."""
    with torch.inference_mode(False):
        h = torch.ones(1, 1)
        while h.shape[0] < size:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        gen = torch.Generator().manual_seed(seed)
        signs = torch.randint(0, 2, (size,), generator=gen).float() * 2 - 1
        return h * signs  # columns scaled: H @ diag(signs)


@functools.lru_cache(maxsize=None)
def _hadamard_cpu(size: int, seed: int) -> torch.Tensor:
    """H_size D / sqrt(size) in float32 (size a power of two): orthogonal."""
    with torch.inference_mode(False):
        return signed_hadamard(size, seed) / size**0.5


def hadamard_tokens(t: torch.Tensor, seed: int, size: int = HADAMARD_SIZE) -> torch.Tensor:
    """Rotate [N, C] along N by the block-diagonal R (float32 out, N padded to a multiple of size)."""
    n = t.shape[0]
    pad = -n % size
    t = F.pad(t.float(), (0, 0, 0, pad)).view(-1, size, t.shape[1])  # (n_blocks, size, C)
    r = _hadamard_cpu(size, seed).to(t.device)
    return torch.matmul(r, t).reshape(-1, t.shape[2])


def compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The GEMM's dtype: autocast's on that device when enabled, else x's and weight's promotion."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(x.dtype, weight.dtype)


class _MXLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, recipe: MXRecipe):
        dtype = compute_dtype(x2d, weight)
        q = functools.partial(mx_qdq, block=recipe.block, scale_rule=recipe.scale_rule, dtype=dtype)
        with torch.autocast(x2d.device.type, enabled=False):
            y = q(x2d, elem=recipe.elem, axis=1) @ q(weight, elem=recipe.elem, axis=1).t()  # (N, M)
        ctx.save_for_backward(x2d, weight)
        ctx.recipe, ctx.dtype = recipe, dtype
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x2d, weight = ctx.saved_tensors
        recipe, dtype = ctx.recipe, ctx.dtype
        rounding = "stochastic" if recipe.stochastic_rounding else "nearest"
        q = functools.partial(mx_qdq, block=recipe.block, scale_rule=recipe.scale_rule, dtype=dtype)
        grad_x = grad_w = None
        with torch.autocast(grad_y.device.type, enabled=False):
            if ctx.needs_input_grad[0]:  # dgrad contracts the out-features M
                g = q(grad_y, elem=recipe.grad_elem, axis=1, rounding=rounding)
                grad_x = (g @ q(weight, elem=recipe.elem, axis=0)).to(x2d.dtype)
            if ctx.needs_input_grad[1]:  # wgrad contracts the tokens N
                if recipe.wgrad_format == "bf16":
                    grad_w = grad_y.to(dtype).t() @ x2d.to(dtype)
                else:
                    gy, xs = grad_y, x2d
                    if recipe.hadamard_wgrad:
                        # Rotated in float32 and quantized from there (a fused kernel would too).
                        gy = hadamard_tokens(gy, recipe.hadamard_seed)
                        xs = hadamard_tokens(xs, recipe.hadamard_seed)
                    g = q(gy, elem=recipe.grad_elem, axis=0, rounding=rounding)
                    grad_w = g.t() @ q(xs, elem=recipe.elem, axis=0)
                grad_w = grad_w.to(weight.dtype)
        return grad_x, grad_w, None


def mx_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: MXRecipe) -> torch.Tensor:
    """F.linear with MX-emulated GEMMs (forward and backward); x [..., K], weight [M, K]."""
    y = _MXLinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, recipe)
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias.to(y.dtype)


def mx_attention_quant(recipe: MXRecipe):
    """The ``operand_quant`` of gemctl.ops.jagged_attention for MXFP8 attention: ``(t, axis) ->``
    t MX-quantized and dequantized along ``axis`` (blocks of ``recipe.block``, ``recipe.elem``,
    ``recipe.scale_rule``) in the forward, the identity for the gradient (straight through)."""

    def quant(t: torch.Tensor, axis: int) -> torch.Tensor:
        flat = t.detach()
        return t + (mx_qdq(flat, recipe.block, recipe.elem, axis=axis, scale_rule=recipe.scale_rule) - flat)

    quant.mx_format = (recipe.elem, recipe.scale_rule, recipe.block)  # the Triton kernel quantizes P in-kernel
    return quant


def use_mx_attention(attention: nn.Module, recipe: MXRecipe) -> None:
    """MXFP8 QK^T and PV operands in a gemctl.model.attention.JaggedSelfAttention (full or window)."""
    attention.operand_quant = mx_attention_quant(recipe)


def use_mx_linear(module: nn.Linear, recipe: MXRecipe) -> None:
    """Route an nn.Linear's forward through mx_linear (the module and its parameters stay as they
    are: state dicts, FSDP units and optimizers see no difference)."""

    def forward(x):
        return mx_linear(x, module.weight, module.bias, recipe)

    module.forward = forward
    module.mx_recipe = recipe
