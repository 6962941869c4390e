"""The GEM-like jagged attention workloads of shared/design/BENCHMARKS.md, one definition for
every benchmark script.

Lengths: L_i = clamp(round(exp(N(0,1) * 0.8 + ln(max_len / 4))), 8, max_len), drawn with
torch.Generator().manual_seed(max_len) for self-attention and manual_seed(7) for cross/PMA;
the "uniform" variant draws L_i uniformly in [0.9 * max_len, max_len] (as the
generative-recommenders benchmark does). bf16, H=4, D=128.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Workload:
    name: str
    q_lengths: torch.Tensor  # [B] int64
    k_lengths: torch.Tensor  # [B] int64
    heads: int = 4
    head_dim: int = 128

    @property
    def batch(self) -> int:
        return self.q_lengths.numel()


def gem_lengths(batch: int, max_len: int, seed: int, uniform: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if uniform:
        low = math.ceil(0.9 * max_len)
        return torch.randint(low, max_len + 1, (batch,), generator=gen)
    z = torch.randn(batch, generator=gen, dtype=torch.float64)
    lengths = torch.exp(z * 0.8 + math.log(max_len / 4)).round()
    return lengths.clamp(8, max_len).to(torch.int64)


def self_workload(batch: int, max_len: int, uniform: bool = False) -> Workload:
    lengths = gem_lengths(batch, max_len, max_len, uniform)
    suffix = "-uniform" if uniform else ""
    return Workload(f"self-{max_len}{suffix}", lengths, lengths)


def cross_workload(batch: int, kv_tokens: int, max_q: int = 1000) -> Workload:
    q = gem_lengths(batch, max_q, 7)
    return Workload(f"cross-{kv_tokens}", q, torch.full((batch,), kv_tokens, dtype=torch.int64))


def pma_workload(batch: int, queries: int, max_k: int = 1000) -> Workload:
    k = gem_lengths(batch, max_k, 7)
    return Workload(f"pma-{queries}", torch.full((batch,), queries, dtype=torch.int64), k)


def attention_workloads(uniform_variant: bool = True) -> list[Workload]:
    out = [self_workload(512, 200), self_workload(512, 500), self_workload(256, 1000)]
    if uniform_variant:
        out += [self_workload(512, 200, True), self_workload(512, 500, True), self_workload(256, 1000, True)]
    out += [cross_workload(256, 32), cross_workload(256, 128)]
    return out


def block_attention_workloads() -> list[Workload]:
    """self-1000 and self-4000 (B=64, max_len 4000, the same length law): the long histories where
    block attention's O(L) cost is compared with full attention's O(L^2)."""
    return [self_workload(256, 1000), self_workload(64, 4000)]


def offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    out[1:] = torch.cumsum(lengths, 0)
    return out
