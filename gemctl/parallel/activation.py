"""Activation checkpointing of the sequence tower's layers (``parallel.activation_checkpoint``), step
2 of parallelize: after sparse sharding and expert parallelism, before torch.compile and FSDP2, the
order torchtitan applies them in.

A checkpointed layer keeps less of its forward for the backward and runs part of the forward again
there. The tower's layers hold most of a step's activations (every history token, every layer), so
this is where memory comes back for a larger batch (GEM.md item 6).

- ``full``: the layer keeps its input only; the backward runs the whole layer forward again
  (non-reentrant ``torch.utils.checkpoint``: autocast and RNG states are restored for the rerun,
  and FSDP2 gathers the unit's parameters for it as for the unit's own backward).
- ``ops``: selective by op. The outputs of the GEMMs (aten mm / addmm / bmm / baddbmm / _scaled_mm)
  and of our attention kernels (every ``gemctl::`` custom op) are kept; norms, activations,
  residual adds and casts run again. The FP8 Linears of an fp8 precision recipe run their GEMMs as
  Triton kernels outside the dispatcher, where no policy can keep them: on a GPU with FP8 tensor
  cores those GEMMs run again too, and the hardware FLOPs count them.
- ``budget``: the layers are compiled (``parallel.compile``) and torch.compile's min-cut
  partitioner chooses what to recompute so that the layers keep at most ``budget`` of their
  activation memory (``torch._functorch.config.activation_memory_budget``, set for the process):
  the compiler-driven checkpointing GEM describes.

The wrap replaces each chosen layer's ``forward`` on the instance, as the precision rules' fp32
wrap does, so module paths, parameter names and checkpoints are those of the unwrapped model.

Model FLOPs never count the recomputation (gemctl.metrics.flops); hardware FLOPs (HFU) add what the
plan says runs again: a ``full`` layer's whole forward, an ``ops`` layer's Triton FP8 GEMMs, and
nothing known for ``budget`` (the partitioner decides inside the compiled graph, so no HFU).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint
from torch import nn


@dataclass(frozen=True)
class CheckpointPlan:
    """What parallelize checkpointed. ``layers``: tower layer indices (full and ops; budget: every
    compiled layer). ``gemm_per_token``: ops mode, per layer index, the forward FLOPs per history
    token of the GEMMs that run again (Triton FP8 Linears; other layers 0)."""

    mode: str = "none"
    layers: tuple[int, ...] = ()
    num_layers: int = 0
    budget: float | None = None
    gemm_per_token: dict[int, int] = field(default_factory=dict)

    @classmethod
    def from_config(cls, ac_cfg, num_layers: int) -> "CheckpointPlan":
        """The plan ``parallel.activation_checkpoint`` asks for (no model needed: gemctl plan uses
        it too); ops mode's recomputed GEMMs are filled in when the layers are wrapped."""
        mode = str(ac_cfg.mode)
        if mode == "budget":
            return cls(mode, tuple(range(num_layers)), num_layers, budget=float(ac_cfg.budget))
        if mode in ("full", "ops"):
            return cls(mode, checkpointed_layers(num_layers, int(ac_cfg.every)), num_layers)
        return cls(num_layers=num_layers)

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def describe(self) -> str:
        if self.mode == "none":
            return "none"
        if self.mode == "budget":
            return f"budget: torch.compile keeps <= {self.budget:g} of the activation memory of {self.num_layers} " \
                   "tower layers"
        what = "whole layer recomputed" if self.mode == "full" else "GEMM and attention outputs kept"
        return f"{self.mode}: {len(self.layers)} of {self.num_layers} tower layers ({what})"


def checkpointed_layers(num_layers: int, every: int) -> tuple[int, ...]:
    """Layers 0, every, 2*every, ... (every=1: all of them)."""
    return tuple(range(0, num_layers, every))


_KEPT_ATEN = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten._scaled_mm.default,
}


def _keep_gemms_and_attention(ctx, op, *args, **kwargs):
    """The ``ops`` policy: keep what is expensive to compute, recompute what is cheap."""
    from torch.utils.checkpoint import CheckpointPolicy

    if op in _KEPT_ATEN or getattr(op, "namespace", None) == "gemctl":
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


# A functools.partial, the form torch.compile traces a checkpoint's context_fn in.
_OPS_CONTEXT = functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, _keep_gemms_and_attention)


def checkpoint_forward(forward, mode: str):
    """``forward`` run under non-reentrant activation checkpointing (``mode`` full or ops) while
    autograd records; unchanged under no_grad (evaluation keeps nothing anyway)."""
    checkpoint = torch.utils.checkpoint
    ops = mode == "ops"

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if ops:  # the global partial itself in the call: torch.compile traces no other form of it
            return checkpoint.checkpoint(forward, *args, use_reentrant=False, context_fn=_OPS_CONTEXT, **kwargs)
        return checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def _recomputed_gemms_per_token(layer: nn.Module, device: torch.device) -> int:
    """Forward GEMM FLOPs per token of ``layer``'s Linears whose GEMMs an ``ops`` checkpoint runs
    again: the FP8 ones where their Triton kernels run (gemctl.precision.fp8_linear)."""
    flops = 0
    for module in layer.modules():
        recipe = getattr(module, "fp8_recipe", None)
        if recipe is None:
            continue
        from gemctl.precision.fp8_linear import triton_gemms

        linears = [module] if isinstance(module, nn.Linear) else [module.up, module.down]  # a fused FP8 MLP
        flops += sum(2 * lin.in_features * lin.out_features for lin in linears
                     if triton_gemms(recipe, lin.in_features, lin.out_features, device))
    return flops


def apply_activation_checkpointing(model, ac_cfg, device: torch.device) -> CheckpointPlan:
    """Checkpoint the tower layers ``ac_cfg`` names (in place); returns the plan."""
    layers = list(model.tower.layers)
    plan = CheckpointPlan.from_config(ac_cfg, len(layers))
    if plan.mode == "budget":
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = plan.budget
        return plan
    if plan.mode == "none":
        return plan
    per_token = {}
    for i in plan.layers:
        layers[i].forward = checkpoint_forward(layers[i].forward, plan.mode)
        if plan.mode == "ops":
            per_token[i] = _recomputed_gemms_per_token(layers[i], device)
    return dataclasses.replace(plan, gemm_per_token=per_token)
