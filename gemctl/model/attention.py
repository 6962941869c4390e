"""Attention layers of the towers; all attention math goes through gemctl.ops."""

from __future__ import annotations

import torch
from torch import nn

from gemctl import ops


def parse_attention_kind(kind: str) -> tuple[str, int]:
    """'full' -> ('full', 0); 'window:256' -> ('window', 256); 'block:64' -> ('block', 64).
    Validation happens in the config."""
    if kind == "full":
        return "full", 0
    name, _, arg = kind.partition(":")
    return name, int(arg)


_rope_cache: dict = {}


def rope_tables(max_len: int, block_size: int, head_dim: int, base: float, device,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (cos, sin) tables ``[n, head_dim // 2]`` for positions 0..n-1 counted from the sequence
    start, frequencies ``base ** (-i / (head_dim // 2))``, computed in float64 and stored in ``dtype``
    (the layer passes ``ops.rope_table_dtype`` of its q). n covers ``max_len`` rounded up to whole
    blocks, then to a power of two, so a new batch seldom builds new tables; built once per
    (n, head_dim, base, device, dtype) and shared by every layer."""
    n = -(-max(max_len, 1) // block_size) * block_size
    n = 1 << max(0, (n - 1).bit_length())
    key = (n, head_dim, float(base), str(device), dtype)
    if key not in _rope_cache:
        if len(_rope_cache) >= 16:  # a few (length bucket, device) pairs at most in a run
            _rope_cache.clear()
        _rope_cache[key] = ops.rope_cos_sin(n, head_dim, base, device, dtype)
    return _rope_cache[key]


class JaggedSelfAttention(nn.Module):
    """Multi-head softmax self-attention over jagged tokens ``[N, d_model]``.

    ``full``: every query sees the keys of its sequence (causal: only earlier ones) plus a learned
    relative-position bias; ``window:<w>``: the same, restricted to the w most recent keys up to
    the query (non-causal: |i - j| < w); ``block:<b>``: each query block of b tokens sees only its
    own block, with rotary position embedding (positions from the sequence start) when
    ``rope_base`` > 0.
    """

    def __init__(self, d_model, num_heads, head_dim, kind="full", causal=True, relpos_buckets=0, relpos_max_distance=128,
                 rope_base=0.0):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.kind, arg = parse_attention_kind(kind)
        self.block_size = arg if self.kind == "block" else 0
        self.window = arg if self.kind == "window" else None
        self.rope_base = float(rope_base or 0.0) if self.kind == "block" else 0.0
        self.causal = causal
        self.qkv = nn.Linear(d_model, 3 * num_heads * head_dim, bias=False)
        self.out = nn.Linear(num_heads * head_dim, d_model, bias=False)
        self.operand_quant = None  # MXFP8 attention operands (gemctl.precision.mx_linear.use_mx_attention)
        self.relpos = None
        if self.kind in ("full", "window") and relpos_buckets > 0:
            self.relpos = nn.Parameter(torch.zeros(num_heads, relpos_buckets))
            self.relpos_max_distance = relpos_max_distance

    def forward(self, x, offsets, max_len, backend="auto"):
        """``backend``: one for every op, or a mapping op name -> backend (model.kernels)."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # (N, H, D) each
        if self.kind == "block":
            rope = None
            if self.rope_base > 0:
                rope = rope_tables(max_len, self.block_size, self.head_dim, self.rope_base, x.device,
                                   ops.rope_table_dtype(q.dtype))
            y = ops.block_attention(
                q, k, v, offsets, max_len, block_size=self.block_size, rope=rope,
                backend=_op_backend(backend, "block_attention"),
            )
        else:
            bias = None
            if self.relpos is not None:
                bias = ops.RelativePositionBias(self.relpos, self.relpos_max_distance)
            y = ops.jagged_attention(
                q, k, v, offsets, offsets, max_len, max_len, bias=bias, causal=self.causal, window=self.window,
                backend=_op_backend(backend, "jagged_attention"), operand_quant=self.operand_quant,
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
