"""Task heads: one small MLP per task (ctr, cvr, ...) producing a logit."""

from __future__ import annotations

import torch
from torch import nn


class TaskHeads(nn.Module):
    def __init__(self, tasks, d_model: int, hidden: int):
        super().__init__()
        self.tasks = list(tasks)
        self.heads = nn.ModuleDict(
            {t: nn.Sequential(nn.Linear(d_model, hidden), nn.SiLU(), nn.Linear(hidden, 1)) for t in self.tasks}
        )

    def forward(self, x):
        """x [B, d_model] -> logits [B, n_tasks] (float32)."""
        return torch.cat([self.heads[t](x).float() for t in self.tasks], dim=1)
