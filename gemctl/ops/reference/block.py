"""PyTorch reference of block attention: each sequence is cut into consecutive ``block_size``
chunks and query chunk i attends (softmax, non-causal) only to key/value chunk i of the same
sequence; the last chunk may be partial. ``rope=(cos, sin)``, each ``[>= max_len, head_dim // 2]``,
rotates q and k by their position from the sequence start (rotate-half convention) first."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gemctl.ops.reference.jagged import pad, unpad


def rope_table_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the rope tables are built in for inputs of ``dtype``: fp16 for 16-bit inputs (the
    tables' rounding, at most 2^-12 on values in [-1, 1], stays well below the rounding of a bf16
    rotated row, 2^-9 relative, and at half of an fp16 one's; the Triton backward reads the rows once
    per gradient, and with half the bytes it took 14% less time at the same config, 22% with the
    config then picked, on the H200: docs/benchmarks.md), fp32 otherwise (fp64 inputs included)."""
    return torch.float16 if dtype in (torch.bfloat16, torch.float16) else torch.float32


def rope_cos_sin(length: int, dim: int, base: float, device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (cos, sin) tables ``[length, dim // 2]`` of positions 0..length-1 and frequencies
    ``base ** (-i / (dim // 2))``, computed in float64 and stored in ``dtype`` on ``device`` (the
    model layer and the Triton op's base-frequency path cache them, each by its own length rule)."""
    half = dim // 2
    inv_freq = float(base) ** (-torch.arange(half, dtype=torch.float64) / half)
    angle = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angle.cos().to(device, dtype), angle.sin().to(device, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., L, H, D) rotated by position: [x1, x2] -> [x1 c - x2 s, x2 c + x1 s]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _rows(table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` rows of a rope table, zero-padded when it has fewer."""
    table = table[:length]
    return F.pad(table, (0, 0, 0, length - table.shape[0])) if table.shape[0] < length else table


def block_attention_reference(q, k, v, offsets, max_len, *, block_size=64, rope=None, scale=None):
    n, heads, dim = q.shape
    scale = dim**-0.5 if scale is None else scale
    if n == 0 or max_len == 0:
        return q * 0.0  # nothing to attend: zeros, still part of the graph
    n_blocks = -(-max_len // block_size)
    length = n_blocks * block_size
    qp, valid = pad(q, offsets, length)  # (B, nb*bs, H, D)
    kp, _ = pad(k, offsets, length)
    vp, _ = pad(v, offsets, length)
    if rope is not None:
        # Tables of exactly max_len rows are allowed: the padded rows (beyond max_len, never valid)
        # are 0 and only meet zero-padded q and k rows.
        cos, sin = (_rows(t, length) for t in rope)
        qp = apply_rope(qp, cos, sin)
        kp = apply_rope(kp, cos, sin)
    b = qp.shape[0]

    def blocks(x):  # (B, nb*bs, H, D) -> (B*nb, H, bs, D)
        return x.view(b * n_blocks, block_size, heads, dim).transpose(1, 2)

    kv_valid = valid.view(b * n_blocks, 1, 1, block_size)
    has_key = kv_valid.any(-1, keepdim=True)
    mask = (kv_valid | ~has_key).expand(-1, 1, block_size, block_size)
    out = F.scaled_dot_product_attention(blocks(qp), blocks(kp), blocks(vp), attn_mask=mask, scale=scale)
    out = out.transpose(1, 2).reshape(b, length, heads, dim)
    return unpad(out, offsets, q.shape[0])
