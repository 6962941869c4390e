"""Sparse arch: torchrec tables for sequence ids (EmbeddingCollection) and non-sequence sparse
features (EmbeddingBagCollection, sum-pooled)."""

from __future__ import annotations

import torch
from torch import nn


class SparseArch(nn.Module):
    def __init__(self, spec, embedding_dim: int, device: torch.device | None = None):
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingCollection
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType

        self.seq_features = list(spec.seq_features)
        self.sparse_features = list(spec.sparse_features)
        self.seq = EmbeddingCollection(
            tables=[
                EmbeddingConfig(name=f"seq_{f}", embedding_dim=embedding_dim, num_embeddings=n, feature_names=[f])
                for f, n in spec.seq_features.items()
            ],
            device=device,
        )
        self.nonseq = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=f"ns_{f}", embedding_dim=embedding_dim, num_embeddings=n, feature_names=[f],
                    pooling=PoolingType.SUM,
                )
                for f, n in spec.sparse_features.items()
            ],
            device=device,
        )

    def forward(self, batch):
        """-> (sequence embeddings [N, n_seq * E], non-sequence pooled embeddings [B, n_sparse, E])."""
        seq = self.seq(batch.seq_kjt())
        seq_emb = torch.cat([seq[f].values() for f in self.seq_features], dim=1)
        pooled = self.nonseq(batch.sparse_kjt()).to_dict()
        ns_emb = torch.stack([pooled[f] for f in self.sparse_features], dim=1)
        return seq_emb, ns_emb
