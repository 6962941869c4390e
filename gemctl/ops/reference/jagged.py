"""Padding helpers shared by the references: jagged [N, ...] <-> padded [B, L, ...]."""

from __future__ import annotations

import torch


def valid_mask(offsets: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B, max_len] bool: position p of row b is a real token."""
    lengths = offsets[1:] - offsets[:-1]
    return torch.arange(max_len, device=offsets.device)[None, :] < lengths[:, None]


def pad(x: torch.Tensor, offsets: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, *rest] -> ([B, max_len, *rest] zero-padded, valid [B, max_len])."""
    valid = valid_mask(offsets, max_len)
    out = x.new_zeros(valid.shape + x.shape[1:])
    out = out.index_put((valid,), x) if x.numel() else out
    return out, valid


def unpad(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, L, *rest] -> [N, *rest] keeping the valid positions (row-major, as the jagged layout)."""
    return x[valid]
