"""Optimizers: AdamW for dense parameters, row-wise Adagrad (or Adam) for embedding tables."""

from __future__ import annotations

import math

import torch


class RowWiseAdagrad(torch.optim.Optimizer):
    """Adagrad with one accumulator per embedding row (the mean of the row's squared gradient).

    The state is ``[rows, 1]`` instead of a full table copy, as FBGEMM's fused TBE optimizer
    keeps it. A table sharded by rows (an FSDP2 DTensor) updates its local rows: the update of a
    row needs only that row. Rows without a gradient this step are left untouched (their update is exactly 0).
    torchrec.optim.RowWiseAdagrad computes the same update for lr_decay=0 but reads its step
    counter with ``.item()``, a device sync per table per step; this one never syncs.
    """

    def __init__(self, params, lr: float = 0.05, eps: float = 1e-8, initial_accumulator_value: float = 0.0):
        super().__init__(params, dict(lr=lr, eps=eps, initial_accumulator_value=initial_accumulator_value))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                param, grad = local_tensor(p), local_tensor(p.grad)
                state = self.state[p]
                if not state:
                    local = torch.full(
                        (param.shape[0], 1), group["initial_accumulator_value"], dtype=torch.float32, device=param.device
                    )
                    state["sum"] = _shaped_like(p, local)
                acc = local_tensor(state["sum"])
                acc.add_(grad.float().pow(2).mean(dim=1, keepdim=True))
                param.addcdiv_(grad, acc.sqrt().add_(group["eps"]).to(param.dtype), value=-group["lr"])
        return loss


def _shaped_like(param, local: torch.Tensor):
    """The row accumulator as the parameter holds it: a DTensor sharded like a DTensor parameter
    (so checkpoints save every rank's rows), else the plain tensor."""
    if not hasattr(param, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=torch.Size((param.shape[0], 1)), stride=(1, 1))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (in place updates reach the parameter), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def build_optimizers(model, train_cfg, device: torch.device, separate: list | None = None):
    """AdamW over the dense parameters (``separate`` ones - expert-parallel weights, plain tensors
    among FSDP2 DTensors - in their own group, so no fused step mixes the two) and the embedding
    optimizer."""
    ids = {id(p) for p in separate or []}
    groups = [{"params": [p for p in model.dense_parameters() if id(p) not in ids]}]
    if ids:
        groups.append({"params": list(separate)})
    dense = torch.optim.AdamW(
        groups,
        lr=train_cfg.lr,
        betas=tuple(train_cfg.betas),
        weight_decay=train_cfg.weight_decay,
        fused=device.type == "cuda",
    )
    if train_cfg.embedding_optimizer == "rowwise_adagrad":
        sparse = RowWiseAdagrad(model.sparse_parameters(), lr=train_cfg.embedding_lr)
    else:
        sparse = torch.optim.Adam(model.sparse_parameters(), lr=train_cfg.embedding_lr, fused=device.type == "cuda")
    return dense, sparse


def lr_lambda(train_cfg):
    """Linear warm-up, then cosine decay to 10% of the peak at the last step."""
    warm, total = train_cfg.warmup_steps, train_cfg.steps

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, total - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return f
