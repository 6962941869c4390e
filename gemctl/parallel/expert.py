"""Expert parallelism (parallel.ep > 1): the experts of every MoE layer are split over groups of
``ep`` consecutive ranks (inside a node and inside a shard group), tokens travel to their
experts' rank and back by all-to-all.

- Placement: rank g of an EP group keeps experts [g E/ep, (g+1) E/ep). Every rank first builds the
  full layer from the common seed, then keeps its slice, so a run starts where one process starts.
- Forward (gemctl.model.moe.MoEMLP with an ``ep`` attached): assignments sorted by expert are
  already grouped by destination rank; counts go first (all-to-all of E integers, read on the host),
  then the token rows (all-to-all with autograd), the local experts run on the rows they received,
  and the results go back the same way.
- Gradients: an expert's gradient sums the local-mean losses of the ep ranks whose tokens it saw,
  so it is divided by ep, then averaged over the ranks that hold the same experts in the other EP
  groups (world / ep of them): the result is the global-mean gradient, as in one process.
- FSDP2 leaves the expert weights alone (they are already split); the gradient-norm clip adds their
  squares over the EP group to the DTensor norm of the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class ExpertGroups:
    ep: int
    index: int  # this rank's position in its EP group
    group: object  # the EP group (all-to-all)
    replicas: object  # ranks holding the same experts (gradient average), None when alone


def build_groups(world: int, rank: int, ep: int) -> ExpertGroups:
    """Every rank creates every group, in the same order (torch.distributed requires it)."""
    mine = replicas = None
    for start in range(0, world, ep):
        g = dist.new_group(list(range(start, start + ep)))
        if start <= rank < start + ep:
            mine = g
    if world > ep:
        for i in range(ep):
            g = dist.new_group(list(range(i, world, ep)))
            if rank % ep == i:
                replicas = g
    return ExpertGroups(ep, rank % ep, mine, replicas)


def shard_experts(model, groups: ExpertGroups) -> list[nn.Parameter]:
    """Keep this rank's experts in every MoE layer; returns the expert parameters (FSDP ignores
    them, ``sync_expert_grads`` averages their gradients)."""
    params = []
    for layer in model.moe_layers:
        if layer.n_experts % groups.ep:
            raise ValueError(f"{layer.n_experts} experts cannot be split over ep={groups.ep}")
        local = layer.n_experts // groups.ep
        lo = groups.index * local
        layer.up = nn.Parameter(layer.up.detach()[lo:lo + local].clone())
        layer.down = nn.Parameter(layer.down.detach()[lo:lo + local].clone())
        layer.ep = groups
        params += [layer.up, layer.down]
    return params


@torch.no_grad()
def sync_expert_grads(params: list[nn.Parameter], groups: ExpertGroups) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    for g in grads:
        g.div_(groups.ep)
    if groups.replicas is not None and grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=groups.replicas)
        flat.div_(dist.get_world_size(groups.replicas))
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def clip_grad_norm(dense_params, expert_params, max_norm: float, groups: ExpertGroups | None) -> torch.Tensor:
    """Clip by the norm of all gradients: the dense ones (DTensors under FSDP2, whose norm is global)
    and the local experts (their squares summed over the EP group: each expert once)."""
    from torch.nn.utils import get_total_norm

    dense = [p.grad for p in dense_params if p.grad is not None]
    experts = [p.grad for p in expert_params if p.grad is not None]
    total = get_total_norm(dense) if dense else torch.zeros(())
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    if groups is not None and experts:
        sq = sum((g.float() ** 2).sum() for g in experts)
        dist.all_reduce(sq, group=groups.group)
        total = (total.float() ** 2 + sq).sqrt()
    # One host read of the coefficient: DTensor and plain gradients are scaled in separate calls.
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    for grads in (dense, experts):
        if grads and coef < 1.0:
            torch._foreach_mul_(grads, coef)
    return total
