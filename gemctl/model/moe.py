"""Mixture-of-experts MLP for the sequence tower (model.moe.n_experts > 0).

Each token's router picks ``top_k`` of ``n_experts`` SiLU MLPs (the dense MLP's shape); their
outputs are summed with the top-k router probabilities renormalised to 1. Dropless: every
assignment is computed (no capacity factor), so the FLOPs are exactly top_k expert MLPs per
token plus the router (gemctl.metrics.flops counts them so).

Load balancing (Switch Transformer): aux = n_experts x sum_e f_e x P_e, with f_e the share of
assignments that went to expert e and P_e the mean router probability of e; 1 when routing is
uniform. The trainer adds model.moe.aux_loss_weight x the sum over layers to the loss. Under a
data-parallel layout each rank balances its own tokens (as Switch does per device), so with a
nonzero weight the loss is not exactly that of one process on the global batch.

Dispatch sorts the assignments by expert and runs one GEMM pair per expert on its contiguous
rows; the per-expert counts are read on the host (one device sync per MoE layer). Expert
parallelism (parallel.ep): gemctl/parallel/expert.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class MoEMLP(nn.Module):
    def __init__(self, d_model: int, hidden: int, n_experts: int, top_k: int):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.router = nn.Linear(d_model, n_experts, bias=False)
        # Expert weights stacked [E, in, out] (the dimension expert parallelism would shard).
        self.up = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.down = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        for w, fan_in in ((self.up, d_model), (self.down, hidden)):  # nn.Linear's default bound
            nn.init.uniform_(w, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
        self.aux_loss: torch.Tensor | None = None
        self.ep = None  # gemctl.parallel.expert.ExpertGroups when the experts are split over ranks

    def route(self, x: torch.Tensor):
        """(gates [N, k] summing to 1, expert ids [N, k], router probabilities [N, E] in fp32)."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        gates, experts = probs.topk(self.top_k, dim=-1)
        return gates / gates.sum(-1, keepdim=True), experts, probs

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [N, d]
        n = x.shape[0]
        gates, experts, probs = self.route(x)
        flat = experts.reshape(-1)  # [N * k]
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k
        counts = torch.bincount(flat, minlength=self.n_experts)
        xs = x[token]  # [N * k, d], grouped by expert
        if self.ep is None:
            y = self._experts(xs, counts.tolist())  # host copy of the counts: one sync per layer
        else:
            y = self._experts_parallel(xs, counts)
        y = y * gates.reshape(-1)[order, None].to(y.dtype)
        out = torch.zeros(n, x.shape[1], dtype=y.dtype, device=x.device).index_add_(0, token, y)
        if n:
            share = counts.float() / (n * self.top_k)
            self.aux_loss = self.n_experts * (share * probs.mean(0)).sum()
        else:
            self.aux_loss = probs.sum() * 0.0
        return out.to(x.dtype)

    def _experts(self, xs: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Rows grouped by (local) expert, ``sizes[e]`` rows for expert e -> their outputs."""
        outs = []
        for e, rows in enumerate(torch.split(xs, sizes)):
            if rows.shape[0]:
                outs.append(F.silu(rows @ self.up[e].to(rows.dtype)) @ self.down[e].to(rows.dtype))
        return torch.cat(outs) if outs else xs.new_zeros(0, xs.shape[1])

    def _experts_parallel(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        from torch.distributed.nn.functional import all_to_all_single

        ep, group = self.ep.ep, self.ep.group
        local = self.n_experts // ep
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)  # [ep, local]: rows each source sends me
        send = counts.view(ep, local).sum(1).tolist()
        recv_by = recv_counts.view(ep, local).tolist()
        recv = [sum(r) for r in recv_by]
        got = all_to_all_single(xs.new_empty(sum(recv), xs.shape[1]), xs, recv, send, group=group)
        # Received rows are ordered (source, expert); the experts want them (expert, source).
        starts, pos = [], 0
        for src in range(ep):
            starts.append([])
            for j in range(local):
                starts[src].append(pos)
                pos += recv_by[src][j]
        order = [torch.arange(starts[s][j], starts[s][j] + recv_by[s][j]) for j in range(local) for s in range(ep)]
        order = torch.cat(order).to(xs.device) if order else torch.zeros(0, dtype=torch.long, device=xs.device)
        out = self._experts(got[order], [sum(recv_by[s][j] for s in range(ep)) for j in range(local)])
        back = torch.empty_like(out).index_copy(0, order, out)  # (source, expert) order again
        return all_to_all_single(xs.new_empty(xs.shape[0], out.shape[1]), back, send, recv, group=group)