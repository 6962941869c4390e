"""Non-sequence tower: non-sequence features become tokens; cross-attention lets the history read
them, and PMA pools the history into a fixed number of tokens. Both run through GDPA."""

from __future__ import annotations

import torch
from torch import nn

from gemctl.model.attention import GDPAttention
from gemctl.model.norm import RMSNorm
from gemctl.ops import host


def fixed_offsets(batch: int, count: int, device) -> torch.Tensor:
    """Offsets of ``count`` tokens per sample, with the host copy kernels plan from (no sync)."""
    # Made on the device rather than copied: a copy from pageable memory waits for the stream.
    on_device = torch.arange(batch + 1, dtype=torch.int64, device=device) * count
    return host.register(on_device, torch.arange(batch + 1, dtype=torch.int64) * count)


class FeatureTokens(nn.Module):
    """One d_model token per sparse feature (its pooled embedding) plus one for the dense features."""

    def __init__(self, n_sparse: int, embedding_dim: int, num_dense: int, d_model: int):
        super().__init__()
        self.sparse = nn.ModuleList(nn.Linear(embedding_dim, d_model) for _ in range(n_sparse))
        self.dense = nn.Linear(num_dense, d_model)
        self.norm = RMSNorm(d_model)

    @property
    def num_tokens(self) -> int:
        return len(self.sparse) + 1

    def forward(self, pooled, dense):
        """pooled [B, n_sparse, E], dense [B, F] -> [B, n_sparse + 1, d_model]."""
        tokens = [proj(pooled[:, i]) for i, proj in enumerate(self.sparse)] + [self.dense(dense)]
        return self.norm(torch.stack(tokens, dim=1))


class CrossAttention(nn.Module):
    """History tokens (jagged queries) attend to the sample's few non-sequence tokens."""

    def __init__(self, cfg):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model)
        self.attn = GDPAttention(cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.gdpa_activation)

    def forward(self, x, offsets, max_len, ns_tokens, backend="auto"):
        b, n_ns, d = ns_tokens.shape
        k_offsets = fixed_offsets(b, n_ns, x.device)
        y = self.attn(self.norm(x), ns_tokens.reshape(b * n_ns, d), offsets, k_offsets, max_len, n_ns, backend)
        return x + y / n_ns  # GDPA does not normalize: average over the fixed number of keys


class PMA(nn.Module):
    """Pooling by multi-head attention: ``num_queries`` learned queries over each history."""

    def __init__(self, cfg):
        super().__init__()
        self.num_queries = cfg.pma_queries
        self.queries = nn.Parameter(torch.randn(cfg.pma_queries, cfg.d_model) * cfg.d_model**-0.5)
        self.attn = GDPAttention(cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.gdpa_activation)
        self.norm = RMSNorm(cfg.d_model)

    def forward(self, x, offsets, max_len, backend="auto"):
        b = offsets.numel() - 1
        p = self.num_queries
        q_offsets = fixed_offsets(b, p, x.device)
        q = self.attn.q(self.queries)  # project the P shared queries once, not once per sample
        q = q.expand(b, p, -1).reshape(b * p, -1)
        y = self.attn.attend(q, x, q_offsets, offsets, p, max_len, backend).view(b, p, -1)
        lengths = (offsets[1:] - offsets[:-1]).clamp(min=1).to(y.dtype)
        return self.norm(y / lengths[:, None, None])  # mean over the history (empty -> zeros)
