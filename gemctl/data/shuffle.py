"""How a step's samples are dealt to ranks: in order (``none``) or by Base Batch Shuffling (``bbs``).

The unit of dealing is a sub-batch of ``sub_batch_size`` samples. A step takes
``world_size * k`` consecutive units of the (shuffled) sample stream, k = local batch / sub-batch
size, and each rank keeps k of them:

- ``none``: rank r keeps units r*k .. r*k + k - 1 (contiguous shards);
- ``bbs`` (GEM's Base Batch Shuffling): the units are ordered by their work, heaviest first, and
  dealt in a snake (boustrophedon) order: ranks 0..W-1 get the k heaviest rounds' units going
  forward, then backward, and so on, so every rank mixes heavy and light units and the per-rank
  totals even out. Work is the unit's total history length (``key: tokens``) or its attention
  work, sum of L^2 (``key: attention``).

Every rank computes the same plan from the same lengths (derived from the seed and the step), so
no cross-rank communication is needed; each unit goes to exactly one rank, and the sample stream
itself is unchanged, so no sample is lost or duplicated across ranks and epochs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KEYS = ("tokens", "attention")
KINDS = ("none", "bbs")


def unit_work(lengths: torch.Tensor, key: str) -> int:
    """Work of one sub-batch from its history lengths."""
    lengths = lengths.to(torch.int64)
    if key == "tokens":
        return int(lengths.sum())
    if key == "attention":
        return int((lengths * lengths).sum())
    raise ValueError(f"shuffle.key must be one of {KEYS}, got {key!r}")


def snake_deal(works: list[int] | torch.Tensor, world_size: int) -> list[list[int]]:
    """Unit positions per rank: sorted heaviest first (ties by position), dealt in snake order."""
    works = torch.as_tensor(works, dtype=torch.int64)
    n = works.numel()
    if n % world_size:
        raise ValueError(f"{n} units cannot be dealt evenly to {world_size} ranks")
    # Stable sort by (-work, position): the same plan on every rank, whatever the sort backend.
    order = sorted(range(n), key=lambda i: (-int(works[i]), i))
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    for round_start in range(0, n, world_size):
        chunk = order[round_start : round_start + world_size]
        if (round_start // world_size) % 2:
            chunk = chunk[::-1]
        for r, unit in enumerate(chunk):
            ranks[r].append(unit)
    return ranks


@dataclass(frozen=True)
class Dealer:
    """Which units of a step one rank keeps."""

    kind: str = "none"
    units_per_rank: int = 1
    world_size: int = 1
    rank: int = 0
    key: str = "tokens"

    @property
    def units_per_step(self) -> int:
        return self.units_per_rank * self.world_size

    def plan(self, unit_lengths: list[torch.Tensor] | None = None) -> list[list[int]]:
        """Positions (0 .. units_per_step-1) of every rank's units within the step.

        ``unit_lengths`` (the history lengths of every unit of the step) is needed for ``bbs``.
        """
        k = self.units_per_rank
        if self.kind == "none":
            return [list(range(r * k, (r + 1) * k)) for r in range(self.world_size)]
        works = [unit_work(lengths, self.key) for lengths in unit_lengths]
        return snake_deal(works, self.world_size)

    def my_units(self, unit_lengths: list[torch.Tensor] | None = None) -> list[int]:
        """This rank's part of :meth:`plan`."""
        return self.plan(unit_lengths)[self.rank]


def build_dealer(shuffle_cfg, batch_size: int, world_size: int = 1, rank: int = 0) -> Dealer:
    if shuffle_cfg is None or shuffle_cfg.kind == "none":
        return Dealer("none", 1, world_size, rank)
    if batch_size % shuffle_cfg.sub_batch_size:
        from gemctl.errors import ConfigError

        raise ConfigError(
            "shuffle.sub_batch_size",
            f"{shuffle_cfg.sub_batch_size} must divide data.batch_size={batch_size}",
        )
    return Dealer("bbs", batch_size // shuffle_cfg.sub_batch_size, world_size, rank, shuffle_cfg.key)
