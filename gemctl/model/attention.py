"""Attention layers of the towers; all attention math goes through gemctl.ops."""

from __future__ import annotations

import torch
from torch import nn

from gemctl import ops


def parse_attention_kind(kind: str) -> tuple[str, int]:
    """'full' -> ('full', 0); 'block:64' -> ('block', 64). Validation happens in the config."""
    if kind == "full":
        return "full", 0
    name, _, arg = kind.partition(":")
    return name, int(arg)


class JaggedSelfAttention(nn.Module):
    """Multi-head softmax self-attention over jagged tokens ``[N, d_model]``.

    ``full``: every query sees the keys of its sequence (causal: only earlier ones) plus a learned
    relative-position bias; ``block:<b>``: each query block of b tokens sees only its own block.
    """

    def __init__(self, d_model, num_heads, head_dim, kind="full", causal=True, relpos_buckets=0, relpos_max_distance=128):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.kind, self.block_size = parse_attention_kind(kind)
        self.causal = causal
        self.qkv = nn.Linear(d_model, 3 * num_heads * head_dim, bias=False)
        self.out = nn.Linear(num_heads * head_dim, d_model, bias=False)
        self.relpos = None
        if self.kind == "full" and relpos_buckets > 0:
            self.relpos = nn.Parameter(torch.zeros(num_heads, relpos_buckets))
            self.relpos_max_distance = relpos_max_distance

    def forward(self, x, offsets, max_len, backend="auto"):
        """``backend``: one for every op, or a mapping op name -> backend (model.kernels)."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # (N, H, D) each
        if self.kind == "block":
            y = ops.block_attention(
                q, k, v, offsets, max_len, block_size=self.block_size, backend=_op_backend(backend, "block_attention")
            )
        else:
            bias = None
            if self.relpos is not None:
                bias = ops.RelativePositionBias(self.relpos, self.relpos_max_distance)
            y = ops.jagged_attention(
                q, k, v, offsets, offsets, max_len, max_len, bias=bias, causal=self.causal,
                backend=_op_backend(backend, "jagged_attention"),
            )
        return self.out(y.reshape(n, self.num_heads * self.head_dim))


class GDPAttention(nn.Module):
    """GDPA (activation instead of softmax) from jagged or fixed-count queries to keys/values.

    Used for PMA (learned queries over the history) and cross-attention (history queries over the
    non-sequence tokens); counts per sample are carried by offsets, so one module covers both.
    The caller scales the unnormalized sum.
    """

    def __init__(self, d_model, num_heads, head_dim, activation="gelu"):
        super().__init__()
        self.num_heads, self.head_dim, self.activation = num_heads, head_dim, activation
        inner = num_heads * head_dim
        self.q = nn.Linear(d_model, inner, bias=False)
        self.kv = nn.Linear(d_model, 2 * inner, bias=False)
        self.out = nn.Linear(inner, d_model, bias=False)

    def forward(self, xq, xkv, q_offsets, k_offsets, max_q_len, max_k_len, backend="auto"):
        return self.attend(self.q(xq), xkv, q_offsets, k_offsets, max_q_len, max_k_len, backend)

    def attend(self, q, xkv, q_offsets, k_offsets, max_q_len, max_k_len, backend="auto"):
        """Like forward, with the queries already projected (``q`` [Nq, H*D])."""
        h, d = self.num_heads, self.head_dim
        q = q.reshape(-1, h, d)
        k, v = self.kv(xkv).view(-1, 2, h, d).unbind(1)
        y = ops.gdpa(q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, activation=self.activation, backend=backend)
        return self.out(y.reshape(-1, h * d))


def _op_backend(backend, op: str) -> str:
    return backend if isinstance(backend, str) else backend[op]
