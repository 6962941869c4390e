"""Sequence tower: N pre-norm layers of [RMSNorm -> attention -> RMSNorm -> MLP] on jagged tokens.

The attention kind is set per layer (model.attention): ``full``, ``window:<w>`` or ``block:<b>``.
"""

from __future__ import annotations

from torch import nn

from gemctl.model.attention import JaggedSelfAttention
from gemctl.model.norm import RMSNorm


class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.act = nn.SiLU()
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class SequenceLayer(nn.Module):
    def __init__(self, cfg, kind: str):
        super().__init__()
        d = cfg.d_model
        self.attn_norm = RMSNorm(d)
        self.attn = JaggedSelfAttention(
            d, cfg.num_heads, cfg.head_dim, kind=kind, causal=cfg.causal,
            relpos_buckets=cfg.relpos_buckets, relpos_max_distance=cfg.relpos_max_distance,
            rope_base=getattr(cfg, "rope_base", 0.0) or 0.0,
        )
        self.mlp_norm = RMSNorm(d)
        moe = getattr(cfg, "moe", None)
        if moe is not None and moe.n_experts:
            from gemctl.model.moe import MoEMLP

            self.mlp = MoEMLP(d, cfg.mlp_ratio * d, moe.n_experts, moe.top_k)
        else:
            self.mlp = MLP(d, cfg.mlp_ratio * d)

    def forward(self, x, offsets, max_len, backend):
        # An FP8 QKV projection or MLP may run its pre-norm itself, fused into its first cast
        # (gemctl.precision.fp8_linear); it then takes the un-normalized input.
        x = x + self.attn(x if getattr(self.attn.qkv, "norm_fused", False) else self.attn_norm(x), offsets, max_len,
                          backend)
        return x + self.mlp(x if getattr(self.mlp, "norm_fused", False) else self.mlp_norm(x))


def layer_kinds(cfg) -> list[str]:
    kinds = list(cfg.attention)
    return kinds * cfg.num_layers if len(kinds) == 1 else kinds


class SequenceTower(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.ModuleList(SequenceLayer(cfg, kind) for kind in layer_kinds(cfg))
        self.norm = RMSNorm(cfg.d_model)

    def forward(self, x, offsets, max_len, backend="auto"):
        for layer in self.layers:
            x = layer(x, offsets, max_len, backend)
        return self.norm(x)
