"""Public kernel API of gemctl.

Every op takes jagged tensors ``[total_tokens, heads, head_dim]`` with int64 offsets ``[B+1]`` and
Python-int maximum lengths (computed once on the host). ``backend`` selects the implementation:
``"torch"`` is the plain PyTorch reference (any device, float32/float64-capable, autograd),
``"triton"`` the bundled Triton kernel, ``"auto"`` Triton on CUDA and the reference elsewhere.
When ``"auto"`` wants a Triton kernel that is not available it falls back to the reference and
says so once per op.

Each call runs inside a ``gemctl.attention.<op>`` profiler range while a profiler runs
(gemctl.ops.ranges), so `gemctl profile` can tell attention time from the GEMMs around it. This
package imports nothing from the rest of gemctl.
"""

from __future__ import annotations

import functools
import sys

import torch

from gemctl.ops.bias import RelativePositionBias, relative_position_bucket
from gemctl.ops.ranges import profiled
from gemctl.ops.reference.attention import check_window, jagged_attention_reference
from gemctl.ops.reference.block import apply_rope, block_attention_reference, rope_cos_sin, rope_table_dtype
from gemctl.ops.reference.gdpa import gdpa_reference
from gemctl.ops.reference.jagged import pad, unpad

__all__ = [
    "RelativePositionBias",
    "relative_position_bucket",
    "jagged_attention",
    "gdpa",
    "block_attention",
    "apply_rope",
    "rope_cos_sin",
    "rope_table_dtype",
    "preload",
    "triton_kernels",
]

BACKENDS = ("auto", "torch", "triton")

# Triton implementations: op name -> (module imported on first use, function, picked by "auto").
# A kernel joins "auto" once its GPU tier has passed and it has been measured on a GPU.
_TRITON_IMPLS = {
    "jagged_attention": ("gemctl.ops.triton.jagged_attention", "jagged_attention_triton", True),
    "gdpa": ("gemctl.ops.triton.gdpa", "gdpa_triton", True),
    # GPU tier on the H200 (2026-11-29): 27 passed on db00617; the fullgraph-compile test, which
    # needed gemctl.ops.preload(), passed on 01cf4d0.
    "block_attention": ("gemctl.ops.triton.block_attention", "block_attention_triton", True),
}
triton_kernels: dict[str, object] = {}  # loaded implementations
_warned: set = set()


def _say_once(key, message: str) -> None:
    """``message`` on stderr the first time ``key`` is seen (a fallback or a kernel left out is said
    once, not at every call)."""
    if key not in _warned:
        _warned.add(key)
        print(f"gemctl.ops: {message}", file=sys.stderr)


def preload() -> dict[str, bool]:
    """Import every bundled Triton implementation now (op -> available). Run before
    ``torch.compile(..., fullgraph=True)`` of code that calls these ops: the first call of an op
    imports its module, which the compiler cannot trace. The trainer does it on CUDA."""
    return {op: _load_triton(op) is not None for op in _TRITON_IMPLS}


def _load_triton(op: str):
    if op not in triton_kernels and op in _TRITON_IMPLS:
        if torch.compiler.is_compiling():
            raise RuntimeError(f"gemctl.ops: the Triton {op} is not loaded yet; call gemctl.ops.preload() before "
                               "torch.compile")
        import importlib

        module, name, _ = _TRITON_IMPLS[op]
        try:
            triton_kernels[op] = getattr(importlib.import_module(module), name)
        except ImportError as exc:  # no triton installed: the reference serves, said once
            triton_kernels[op] = None
            print(f"gemctl.ops: Triton {op} unavailable ({exc}); using the PyTorch reference", file=sys.stderr)
    return triton_kernels.get(op)


def _pick(op: str, backend: str, device: torch.device):
    """The Triton kernel to run, or None for the PyTorch reference."""
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return None
    if backend == "triton":
        kernel = _load_triton(op)
        if kernel is None:
            raise NotImplementedError(f"{op}: no Triton kernel is bundled in this version; use backend='torch'")
        return kernel
    if device.type != "cuda":  # auto
        return None
    kernel = _load_triton(op) if op in _TRITON_IMPLS and _TRITON_IMPLS[op][2] else None
    if kernel is None:
        _say_once(op, f"no GPU-verified Triton {op} kernel; using the PyTorch reference on CUDA")
    return kernel


def jagged_attention(
    q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, *, bias=None, causal=False, scale=None, window=None,
    backend="auto", operand_quant=None,
):
    """Softmax attention per sequence over jagged q ``[Nq, H, D]`` and k/v ``[Nk, H, D]``.

    K/V lengths may differ from Q lengths; ``causal`` aligns the last query with the last key;
    ``bias`` is a :class:`RelativePositionBias` (learned ``[H, n_buckets]`` table, with gradient).
    ``window = w`` (an int >= 1; None: no window) is a sliding window on the aligned distance
    ``d = (i + Lk - Lq) - j``: with ``causal`` query i sees the w most recent keys up to its own
    position (0 <= d < w); without it the window is symmetric (|d| < w, up to 2w - 1 keys).
    The Triton kernel skips the tiles outside the window: O(L * w) work instead of O(L^2).
    A query with no key outputs zeros.

    ``operand_quant``: a callable ``(tensor, axis) -> tensor`` applied to the operands of both
    GEMMs along their contraction axes (q and k along D; the probabilities and v along the keys,
    blocks starting at each sequence's first key), e.g. MX quantize-dequantize
    (gemctl.precision.mx_linear.mx_attention_quant). The probabilities are quantized before
    normalization, relative to each row's maximum score rounded up to an integer in log2 units:
    ``out = q(exp2(s - M)) v / sum(exp2(s - M))`` (gemctl.ops.reference.attention). The Triton
    kernel quantizes them in-kernel (MX formats with blocks of 32: ``operand_quant.mx_format``);
    "auto" runs it on CUDA (GPU tier passed on the H200, 2026-11-30). Other quantizers: the
    reference only (said once on CUDA).
    """
    check_window(window)
    if operand_quant is not None:
        fmt = getattr(operand_quant, "mx_format", None)
        kernel, code = _pick("jagged_attention", backend, q.device), 0
        if kernel is not None:
            from gemctl.ops.triton.jagged_attention import mx_p_code

            code = mx_p_code(*fmt) if fmt is not None else 0
            if not code and backend == "triton":
                raise ValueError("jagged_attention: backend 'triton' quantizes operands in MX formats with blocks of "
                                 f"32 (E4M3 or E5M2, scale rule floor or rceil); got {fmt}: use backend 'auto' or 'torch'")
        if code:
            q, k = operand_quant(q, -1), operand_quant(k, -1)  # along D: the jagged rows quantize as they are
            v = unpad(operand_quant(pad(v, k_offsets, max(int(max_k_len), 1))[0], 1), k_offsets, v.shape[0])
            fn = functools.partial(kernel, mx_p=code)
        else:
            if kernel is not None:  # auto on CUDA, a format the kernel does not have
                _say_once("jagged_attention:operand_quant",
                          f"jagged_attention with operands quantized as {fmt} runs the PyTorch reference on CUDA: the "
                          "Triton kernel quantizes MX formats with blocks of 32 only")
            fn = functools.partial(jagged_attention_reference, operand_quant=operand_quant)
    else:
        fn = _pick("jagged_attention", backend, q.device) or jagged_attention_reference
    with profiled("gemctl.attention.jagged_attention"):
        return fn(q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, bias=bias, causal=causal, scale=scale,
                  window=None if window is None else int(window))


def gdpa(q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, *, activation="gelu", scale=None, backend="auto"):
    """Generalized dot-product attention: ``out_i = sum_j act(scale * q_i . k_j) v_j`` per sequence.

    No softmax and no normalization (callers scale). Covers self-attention (jagged Q = K/V),
    PMA (a fixed number of queries per sample over jagged K/V) and cross-attention (jagged Q over
    a few K/V tokens per sample): fixed-length sides are expressed through offsets.
    """
    kernel = _pick("gdpa", backend, q.device)
    fn = kernel or gdpa_reference
    with profiled("gemctl.attention.gdpa"):
        return fn(q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, activation=activation, scale=scale)


BLOCK_KERNEL_SIZES = (16, 32, 64, 128)  # block sizes the Triton block_attention takes (GEM uses 64)
BLOCK_KERNEL_DIMS = (32, 64, 128)  # and head dims


def block_kernel_takes(block_size: int, head_dim: int) -> bool:
    """Whether the Triton block_attention runs this block size and head dim (``backend="auto"`` takes
    the reference, said once, where it does not; ``"triton"`` raises)."""
    return block_size in BLOCK_KERNEL_SIZES and head_dim in BLOCK_KERNEL_DIMS


def block_attention(q, k, v, offsets, max_len, *, block_size=64, rope=None, backend="auto"):
    """Softmax attention inside consecutive ``block_size`` chunks of each sequence.

    ``rope=(cos, sin)`` tables ``[>= max_len, D // 2]`` rotate q and k by position first (inside
    the kernel with the Triton backend, forward and backward). The Triton backend also takes a
    float base frequency (tables built and cached on the device); the reference takes tables only.
    cos and sin share one float dtype: the Triton kernels read them in it and rotate in fp32 in the
    forward and the backward alike (the backward's recomputed softmax is then the forward's), the
    reference casts them to q's dtype. ``rope_table_dtype(q.dtype)``
    is the dtype to build them in: fp16 for bf16/fp16 q, with which the Triton backward took 22% less
    time than with fp32 tables (H200, docs/benchmarks.md).
    """
    kernel = _pick("block_attention", backend, q.device)
    if kernel is not None and backend == "auto" and not block_kernel_takes(block_size, q.shape[-1]):
        _say_once(("block_attention", block_size, q.shape[-1]),
                  f"the Triton block_attention takes block sizes {BLOCK_KERNEL_SIZES} and head dims "
                  f"{BLOCK_KERNEL_DIMS}; block_size {block_size} with head_dim {q.shape[-1]} runs on the PyTorch "
                  "reference")
        kernel = None
    if kernel is None and rope is not None and not isinstance(rope, (tuple, list)):
        raise TypeError("block_attention: the PyTorch reference takes rope=(cos, sin) tables, not a base frequency")
    fn = kernel or block_attention_reference
    with profiled("gemctl.attention.block_attention"):
        return fn(q, k, v, offsets, max_len, block_size=block_size, rope=rope)
