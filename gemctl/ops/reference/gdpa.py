"""PyTorch reference of GDPA: out_i = sum_j act(scale * q_i . k_j) v_j over the valid keys j of
the same sequence (no softmax, no normalization). Padded bmm -> activation -> bmm."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gemctl.ops.reference.jagged import pad, unpad

ACTIVATIONS = ("gelu", "silu")


def activation_fn(name: str):
    if name == "gelu":
        return lambda x: F.gelu(x)  # exact erf GELU
    if name == "silu":
        return F.silu
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


def gdpa_reference(q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, *, activation="gelu", scale=None):
    act = activation_fn(activation)
    dim = q.shape[-1]
    scale = dim**-0.5 if scale is None else scale
    if q.shape[0] == 0 or max_q_len == 0 or max_k_len == 0:
        return q * 0.0  # no keys anywhere: zeros, still part of the graph
    qp, q_valid = pad(q, q_offsets, max_q_len)  # (B, Lq, H, D)
    kp, k_valid = pad(k, k_offsets, max_k_len)  # (B, Lk, H, D)
    vp, _ = pad(v, k_offsets, max_k_len)
    scores = torch.einsum("bqhd,bkhd->bhqk", qp, kp) * scale
    weights = act(scores) * k_valid[:, None, None, :].to(scores.dtype)
    out = torch.einsum("bhqk,bkhd->bqhd", weights, vp)
    return unpad(out, q_offsets, q.shape[0])
