r"""The GEM-like model, top level.

    sparse ids --torchrec--> history embeddings [N, n_seq*E] --proj--> tokens [N, d]
                        \--> pooled non-sequence embeddings [B, n_sparse, E] + dense [B, F]
                             --FeatureTokens--> non-sequence tokens [B, n_ns, d]
    tokens += CrossAttention(tokens -> non-sequence tokens)         (GDPA, jagged Q, short K/V)
    tokens = SequenceTower(tokens)                                   (jagged softmax attention)
    pooled = PMA(learned queries -> tokens)                          (GDPA, few Q, jagged K/V)
    x = Interaction([pooled, non-sequence tokens])  ->  TaskHeads -> logits [B, n_tasks]
"""

from __future__ import annotations

import torch
from torch import nn

from gemctl.model.heads import TaskHeads
from gemctl.model.interaction import Interaction
from gemctl.model.nonsequence import PMA, CrossAttention, FeatureTokens
from gemctl.model.sequence import SequenceTower
from gemctl.model.sparse import SparseArch
from gemctl.ops.ranges import profiled


class GemModel(nn.Module):
    def __init__(self, cfg, spec, device: torch.device | None = None, backend: str = "auto"):
        super().__init__()
        self.cfg, self.spec = cfg, spec
        # Per-op implementation (model.kernels); a backend other than "auto" overrides every op.
        kernels = getattr(cfg, "kernels", None)
        self.backends = {
            op: backend if backend != "auto" else str(getattr(kernels, op, "auto"))
            for op in ("jagged_attention", "gdpa", "block_attention")
        }
        e, d = cfg.embedding_dim, cfg.d_model
        self.sparse = SparseArch(spec, e, device=device)
        self.seq_in = nn.Linear(len(spec.seq_features) * e, d)
        self.ns_tokens = FeatureTokens(len(spec.sparse_features), e, spec.num_dense, d)
        self.cross = CrossAttention(cfg)
        self.tower = SequenceTower(cfg)
        self.pma = PMA(cfg)
        self.interaction = Interaction(cfg.pma_queries + self.ns_tokens.num_tokens, d, cfg.interaction_layers, cfg.interaction_rank)
        self.heads = TaskHeads(spec.tasks, d, cfg.head_hidden)
        from gemctl.model.moe import MoEMLP

        # Plain list (not a ModuleList): the layers stay registered once, under the tower.
        self.moe_layers = [m for m in self.tower.modules() if isinstance(m, MoEMLP)]
        if device is not None:
            self.to(device)

    def aux_loss(self):
        """Sum over MoE layers of their load-balancing loss from the last forward (None: no MoE)."""
        losses = [m.aux_loss for m in self.moe_layers if m.aux_loss is not None]
        return sum(losses) if losses else None

    def dense_parameters(self):
        return [p for n, p in self.named_parameters() if not n.startswith("sparse.")]

    def sparse_parameters(self):
        return list(self.sparse.parameters())

    def forward(self, batch):
        offsets, max_len = batch.seq_offsets, batch.max_seq_len
        with profiled("gemctl.embedding"):
            seq_emb, ns_emb = self.sparse(batch)
        ns = self.ns_tokens(ns_emb, batch.dense)  # (B, n_ns, d)
        x = self.seq_in(seq_emb)  # (N, d)
        x = self.cross(x, offsets, max_len, ns, self.backends["gdpa"])
        x = self.tower(x, offsets, max_len, self.backends)
        pooled = self.pma(x, offsets, max_len, self.backends["gdpa"])  # (B, P, d)
        z = self.interaction(torch.cat([pooled, ns], dim=1))
        return self.heads(z)


def build_model(model_cfg, spec, device=None, backend: str = "auto") -> GemModel:
    return GemModel(model_cfg, spec, device=device, backend=backend)
