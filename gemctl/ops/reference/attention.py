"""PyTorch reference of jagged softmax attention (padded, any float dtype, autograd).

out_i = sum_j softmax_j(scale * q_i . k_j + bias_ij) v_j over the keys j of the same sequence,
with keys after the query excluded when causal (the last query is aligned with the last key).
``window = w`` keeps only keys at aligned distance d = (i + Lk - Lq) - j with 0 <= d < w when
causal (the w most recent keys up to the query's own position) and |d| < w when not causal.
A query row with no valid key (an empty key sequence, or causal with Lq > Lk) outputs zeros.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

from gemctl.ops.bias import RelativePositionBias, relative_position_bucket
from gemctl.ops.reference.jagged import pad, unpad


def check_window(window) -> None:
    """``window`` is None (no window) or an int >= 1; anything else is a ValueError."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1):
        raise ValueError(f"jagged_attention: window must be None or an int >= 1, got {window!r}")


def _relative_distance(q_offsets, k_offsets, max_q_len, max_k_len):
    """Distance d = (i + Lk_b - Lq_b) - j (last query aligned with last key): [B, Lq, Lk], or
    [1, Lq, Lk] for self-attention (same offsets object), where it does not depend on b."""
    i = torch.arange(max_q_len, device=q_offsets.device)[None, :, None]
    j = torch.arange(max_k_len, device=q_offsets.device)[None, None, :]
    if q_offsets is k_offsets:
        return i - j
    lq = (q_offsets[1:] - q_offsets[:-1])[:, None, None]
    lk = (k_offsets[1:] - k_offsets[:-1])[:, None, None]
    return i + lk - lq - j


def _bias_scores(bias: RelativePositionBias, dist: torch.Tensor, dtype) -> torch.Tensor:
    """table[h, bucket(dist)] as (B or 1, H, Lq, Lk).

    Self-attention (dist = i - j, shared by the batch) builds the Toeplitz matrix from the 2L-1
    per-distance values with a strided window view, so the table's gradient is a sum over
    diagonals. A plain gather ``table[:, bucket]`` is correct too, but its backward accumulates
    Lq*Lk indices into n_buckets slots and ran at ~1 s per layer at L=4000 on an H200 (the
    sort-based index_put serializes the duplicates; measured 2026-11-29).
    """
    table = bias.table.to(dtype)
    if dist.shape[0] == 1 and dist.shape[1] == dist.shape[2]:
        length = dist.shape[1]
        d = torch.arange(length - 1, -length, -1, device=dist.device)  # d = L-1 ... -(L-1)
        per_distance = table[:, relative_position_bucket(d, bias.num_buckets, bias.max_distance)]
        # windows[h, k, j] = per_distance[h, k + j] = value at d = L-1-k-j; row i = L-1-k.
        windows = per_distance.unfold(1, length, 1)  # (H, L, L)
        return windows.flip(1)[None]  # (1, H, L, L) with [i, j] -> d = i - j
    bucket = relative_position_bucket(dist, bias.num_buckets, bias.max_distance)
    return table[:, bucket].transpose(0, 1)  # (B, H, Lq, Lk)


_LOG2E = 1.4426950408889634


def jagged_attention_reference(
    q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, *, bias=None, causal=False, scale=None, window=None,
    operand_quant=None,
):
    check_window(window)
    n_q, heads, dim = q.shape
    scale = dim**-0.5 if scale is None else scale
    if n_q == 0 or max_q_len == 0:
        return q * 0.0  # nothing to attend: zeros, still part of the graph
    max_k_len = max(max_k_len, 1)
    if q.is_cuda:  # SDPA's memory-efficient kernel wants the mask's last dim 16-aligned
        max_q_len, max_k_len = -(-max_q_len // 16) * 16, -(-max_k_len // 16) * 16
    qp, q_valid = pad(q, q_offsets, max_q_len)  # (B, Lq, H, D)
    kp, k_valid = pad(k, k_offsets, max_k_len)  # (B, Lk, H, D)
    vp, _ = pad(v, k_offsets, max_k_len)
    dist = _relative_distance(q_offsets, k_offsets, max_q_len, max_k_len)  # (B, Lq, Lk)
    allowed = q_valid[:, :, None] & k_valid[:, None, :]
    if causal:
        allowed &= dist >= 0
    if window is not None:  # a dense mask: the reference costs O(L^2) whatever the window
        allowed &= dist < window
        if not causal:
            allowed &= dist > -window
    has_key = allowed.any(-1)  # (B, Lq)
    # Rows without any key attend to everything (finite softmax) and are zeroed afterwards.
    allowed |= ~has_key[:, :, None]
    mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
    mask = mask.masked_fill(~allowed, float("-inf"))[:, None]  # (B, 1, Lq, Lk)
    if bias is not None:
        if not isinstance(bias, RelativePositionBias):
            raise TypeError("bias must be a gemctl.ops.RelativePositionBias")
        mask = mask + _bias_scores(bias, dist, q.dtype)
    if operand_quant is None:
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), attn_mask=mask, scale=scale
        ).transpose(1, 2)  # (B, Lq, H, D)
    else:  # the two GEMMs on quantized operands, each along its contraction axis
        qh, kh = operand_quant(qp, -1).transpose(1, 2), operand_quant(kp, -1).transpose(1, 2)  # (B, H, L, D)
        vh = operand_quant(vp, 1).transpose(1, 2)  # keys padded after each sequence: blocks start at its first key
        # The probabilities are quantized before normalization, relative to the row's maximum
        # rounded up to an integer in log2 units (what a flash kernel can reproduce exactly: its
        # running maximum then moves by powers of two, under which MX quantization is exact), and
        # normalized by the unquantized sum: out = q(exp2(s - M)) v / sum(exp2(s - M)).
        # float32 from the scores on (the softmax kernels do the same internally); the quantized
        # probabilities are exact in bf16 (FP8 values times powers of two).
        s2 = ((qh @ kh.transpose(-1, -2)).float() * scale + mask.float()) * _LOG2E  # (B, H, Lq, Lk), log2 units
        p = torch.exp2(s2 - torch.ceil(s2.amax(-1, keepdim=True)).detach())
        pv = (operand_quant(p, -1).to(vh.dtype) @ vh).float()
        out = (pv / p.sum(-1, keepdim=True)).to(q.dtype).transpose(1, 2)
    out = out * has_key[:, :, None, None].to(out.dtype)
    return unpad(out, q_offsets, q.shape[0])
