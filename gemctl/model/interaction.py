"""Cross-feature interaction over the pooled tokens: projection then low-rank cross layers
(DCN-v2 style: x_{l+1} = x_0 * (U V x_l + b) + x_l)."""

from __future__ import annotations

from torch import nn


class CrossLayer(nn.Module):
    def __init__(self, width: int, rank: int):
        super().__init__()
        self.v = nn.Linear(width, rank, bias=False)
        self.u = nn.Linear(rank, width)

    def forward(self, x0, x):
        return x0 * self.u(self.v(x)) + x


class Interaction(nn.Module):
    def __init__(self, num_tokens: int, d_model: int, num_layers: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(num_tokens * d_model, d_model)
        self.layers = nn.ModuleList(CrossLayer(d_model, rank) for _ in range(num_layers))
        self.norm = nn.LayerNorm(d_model)

    def forward(self, tokens):
        """tokens [B, T, d_model] -> [B, d_model]."""
        x0 = self.proj(tokens.flatten(1))
        x = x0
        for layer in self.layers:
            x = layer(x0, x)
        return self.norm(x)
