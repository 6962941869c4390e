"""Analytic model FLOPs from the batch's real jagged lengths: the one definition used everywhere.

Rules (ARCHITECTURE.md, "MFU accounting"):
- a GEMM of (m x k) by (k x n) is 2*m*k*n; m is the number of real tokens, never padded ones;
- softmax attention forward is 4*H*D*(number of attended (query, key) pairs): 2*H*D for QK^T and
  2*H*D for PV per pair. Non-causal: sum_i Lq_i*Lk_i. Causal (last query aligned with the last
  key): the pairs with key position <= query position, sum_i [Lq*Lk - Lq*(Lq-1)/2] for Lq <= Lk,
  i.e. L*(L+1)/2 for self-attention ("causal halves"). Block attention counts only pairs inside
  the same block: sum over blocks of len(block)^2; a sliding window of w counts the pairs at
  distance 0 <= i - j < w (causal) or |i - j| < w (not causal);
- GDPA is two GEMMs with a pointwise activation: 4*H*D per (query, key) pair as well;
- embedding lookups, norms, activations, biases and the optimizer count 0;
- backward is 2x forward, so a training step is 3x forward. Recomputation (activation
  checkpointing) is never counted: that would be hardware FLOPs, not model FLOPs.

Hardware FLOPs (HFU) are the model FLOPs plus the forward work activation checkpointing runs again
(gemctl.parallel.activation): a ``full`` layer's whole forward, the Triton FP8 GEMMs of an ``ops``
layer; unknown (None) under ``budget``, where torch.compile's partitioner decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def gemm(m: int, k: int, n: int) -> int:
    """FLOPs of an (m x k) @ (k x n) product."""
    return 2 * m * k * n


def attention_pairs(q_lengths: torch.Tensor, k_lengths: torch.Tensor, causal: bool) -> int:
    """Number of (query, key) pairs attended, summed over sequences (int64 host math)."""
    lq = q_lengths.to(torch.int64)
    lk = k_lengths.to(torch.int64)
    if not causal:
        return int((lq * lk).sum())
    # Query i (0-based) of a sequence sees keys 0 .. i + Lk - Lq, clamped to [0, Lk].
    # For Lq <= Lk: Lq*Lk - Lq*(Lq-1)/2. For Lq > Lk the first Lq-Lk queries see nothing and the
    # rest form a causal Lk x Lk triangle: Lk*(Lk+1)/2.
    full = lq * lk - lq * (lq - 1) // 2
    over = lk * (lk + 1) // 2
    return int(torch.where(lq <= lk, full, over).sum())


def block_attention_pairs(lengths: torch.Tensor, block_size: int) -> int:
    """Pairs inside consecutive blocks of ``block_size`` tokens (last block partial)."""
    lengths = lengths.to(torch.int64)
    full_blocks = lengths // block_size
    rest = lengths % block_size
    return int((full_blocks * block_size * block_size + rest * rest).sum())


def window_attention_pairs(lengths: torch.Tensor, window: int, causal: bool) -> int:
    """Self-attention pairs within a sliding window of ``window`` keys (ops.jagged_attention)."""
    n = lengths.to(torch.int64)
    m = torch.clamp(n - 1, max=window - 1).clamp(min=0)  # largest distance that occurs
    one_side = m * n - m * (m + 1) // 2  # pairs at distance 1..m: sum of (L - d)
    return int((n + (1 if causal else 2) * one_side).sum())


def attention(heads: int, head_dim: int, pairs: int) -> int:
    """Forward FLOPs of softmax attention or GDPA over ``pairs`` (query, key) pairs."""
    return 4 * heads * head_dim * pairs


@dataclass
class FlopCount:
    """Forward FLOPs by component; training counts 3x (backward = 2x forward)."""

    forward: dict[str, int] = field(default_factory=dict)
    recompute: int | None = 0  # forward FLOPs activation checkpointing runs again; None: not known

    def add(self, name: str, flops: int) -> None:
        self.forward[name] = self.forward.get(name, 0) + int(flops)

    @property
    def forward_total(self) -> int:
        return sum(self.forward.values())

    @property
    def train_total(self) -> int:
        return 3 * self.forward_total

    @property
    def hardware_total(self) -> int | None:
        """Training FLOPs with the recomputation (HFU's numerator); None where it is not known."""
        return None if self.recompute is None else self.train_total + self.recompute

    @property
    def attention_total(self) -> int:
        return sum(v for k, v in self.forward.items() if k.endswith(".attention"))

    @property
    def attention_share(self) -> float:
        total = self.forward_total
        return self.attention_total / total if total else 0.0


def _tower_layer(c, lengths: torch.Tensor, n: int, kind: str) -> dict[str, int]:
    """Forward FLOPs of one sequence-tower layer by component."""
    from gemctl.model.attention import parse_attention_kind

    d, inner = c.d_model, c.num_heads * c.head_dim
    out = {"tower.proj": gemm(n, d, 3 * inner) + gemm(n, inner, d)}
    moe = getattr(c, "moe", None)
    if moe is not None and moe.n_experts:  # router + top_k expert MLPs per token (dropless)
        out["tower.router"] = gemm(n, d, moe.n_experts)
        out["tower.mlp"] = moe.top_k * 2 * gemm(n, d, c.mlp_ratio * d)
    else:
        out["tower.mlp"] = 2 * gemm(n, d, c.mlp_ratio * d)
    name, block = parse_attention_kind(kind)
    if name == "block":
        pairs = block_attention_pairs(lengths, block)
    elif name == "window":
        pairs = window_attention_pairs(lengths, block, c.causal)
    else:
        pairs = attention_pairs(lengths, lengths, c.causal)
    out["tower.attention"] = attention(c.num_heads, c.head_dim, pairs)
    return out


def gem_flops(model_cfg, spec, seq_lengths: torch.Tensor, checkpoint=None) -> FlopCount:
    """Forward FLOPs of :class:`gemctl.model.GemModel` on a batch with these history lengths.

    ``seq_lengths`` is the host tensor of per-sample lengths ``[B]``; nothing here touches the
    device. Mirrors the model's structure module by module (a test checks every GEMM against
    torch's FLOP counter on the real model). ``checkpoint``: the activation-checkpointing plan
    (gemctl.parallel.activation.CheckpointPlan), for the recomputed FLOPs.
    """
    from gemctl.model.sequence import layer_kinds

    c = model_cfg
    lengths = seq_lengths.to(torch.int64).cpu()
    b = lengths.numel()
    n = int(lengths.sum())
    d, e = c.d_model, c.embedding_dim
    h, hd = c.num_heads, c.head_dim
    inner = h * hd
    n_sparse = len(spec.sparse_features)
    n_ns = n_sparse + 1  # one token per sparse feature + one for the dense features
    p = c.pma_queries
    fc = FlopCount()

    fc.add("seq_in", gemm(n, len(spec.seq_features) * e, d))
    fc.add("ns_tokens", n_sparse * gemm(b, e, d) + gemm(b, spec.num_dense, d))

    # Cross-attention: history queries over the n_ns non-sequence tokens of the sample.
    fc.add("cross.proj", gemm(n, d, inner) + gemm(b * n_ns, d, 2 * inner) + gemm(n, inner, d))
    fc.add("cross.attention", attention(h, hd, int(lengths.sum()) * n_ns))

    mode = checkpoint.mode if checkpoint is not None else "none"
    for i, kind in enumerate(layer_kinds(c)):
        layer = _tower_layer(c, lengths, n, kind)
        for name, flops in layer.items():
            fc.add(name, flops)
        if mode == "full" and i in checkpoint.layers:
            fc.recompute += sum(layer.values())
        elif mode == "ops":
            fc.recompute += n * checkpoint.gemm_per_token.get(i, 0)
    if mode == "budget":
        fc.recompute = None

    # PMA: the P learned queries are projected once per step, keys/values per history token.
    fc.add("pma.proj", gemm(p, d, inner) + gemm(n, d, 2 * inner) + gemm(b * p, inner, d))
    fc.add("pma.attention", attention(h, hd, p * n))

    fc.add(
        "interaction",
        gemm(b, (p + n_ns) * d, d)
        + c.interaction_layers * (gemm(b, d, c.interaction_rank) + gemm(b, c.interaction_rank, d)),
    )
    fc.add("heads", len(spec.tasks) * (gemm(b, d, c.head_hidden) + gemm(b, c.head_hidden, 1)))
    return fc
