"""Additive attention bias computed from a learned table: relative-position buckets.

``RelativePositionBias(table, max_distance)`` with ``table`` of shape ``[H, n_buckets]`` adds
``table[h, bucket(d)]`` to the score of query i and key j of the same sequence, where
``d = (i + Lk - Lq) - j`` is the distance between the key and the query once the last query is
aligned with the last key (the alignment ``causal`` uses). Buckets: distances below
``n_exact = n_buckets // 2`` get a bucket each; larger ones share log-spaced buckets up to
``max_distance`` (T5-style), so a long history costs no more table. Negative distances (future
keys, non-causal attention) use the bucket of ``|d|``. The bias is a pure function of positions and
the table, so a kernel computes it in registers from two integers and one gather, and the table's
gradient is a scatter-add of the score gradient over buckets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class RelativePositionBias:
    table: torch.Tensor  # [H, n_buckets], learned
    max_distance: int

    @property
    def num_buckets(self) -> int:
        return self.table.shape[1]


def relative_position_bucket(distance: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """Bucket index (int64) of integer distances; see the module docstring."""
    d = distance.abs()
    n_exact = max(num_buckets // 2, 1)
    if num_buckets <= n_exact or max_distance <= n_exact:
        return d.clamp(max=num_buckets - 1)
    log_ratio = math.log(max_distance / n_exact)
    far = n_exact + (
        torch.log(d.clamp(min=1).to(torch.float32) / n_exact) / log_ratio * (num_buckets - n_exact)
    ).floor().to(torch.int64)
    return torch.where(d < n_exact, d, far.clamp(max=num_buckets - 1))
