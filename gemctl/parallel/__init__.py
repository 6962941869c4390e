"""Parallel layouts: the device mesh from the layout, and `parallelize`, which applies them to the
model in one fixed order (STYLE.md, after torchtitan's parallelize):

    1. sparse sharding      - parallel.sparse.sharding=torchrec: DistributedModelParallel over the
                              tables (gemctl.parallel.sparse); fsdp: tables are FSDP row shards
    1b. expert parallelism  - parallel.ep > 1: MoE experts split over EP groups (gemctl.parallel.expert)
    2. activation checkpointing - parallel.activation_checkpoint: tower layers (gemctl.parallel.activation)
    3. torch.compile        - parallel.compile: every sequence-tower layer (gemctl.parallel.compile)
    4. FSDP2 / HSDP          - every dense block, then the root (gemctl.parallel.dense)
"""

from dataclasses import dataclass, field

from gemctl.parallel.activation import CheckpointPlan, apply_activation_checkpointing
from gemctl.parallel.dense import apply_fsdp
from gemctl.parallel.mesh import ParallelContext, init_parallel


@dataclass
class Parallelized:
    table_plan: dict | None = None  # torchrec placement per table
    fused_sparse: object = None  # the tables' fused optimizer (torchrec)
    expert_groups: object = None  # gemctl.parallel.expert.ExpertGroups (ep > 1)
    expert_params: list = field(default_factory=list)
    compiled_layers: int = 0  # sequence-tower layers under torch.compile (parallel.compile)
    checkpoint: CheckpointPlan = field(default_factory=CheckpointPlan)  # activation checkpointing


def parallelize(model, ctx: ParallelContext, cfg, device, formats: dict[str, str]) -> Parallelized:
    """Apply the layout of ``ctx`` to ``model`` (in place); a process outside torchrun is only
    checkpointed and compiled (parallel.activation_checkpoint, parallel.compile), not sharded."""
    out = Parallelized()
    if not ctx.sharded:
        out.checkpoint = apply_activation_checkpointing(model, cfg.parallel.activation_checkpoint, device)
        _compile(model, cfg, out)
        return out
    ignored = set()
    if cfg.parallel.sparse.sharding == "torchrec":
        from gemctl.parallel.sparse import shard_tables

        out.table_plan, out.fused_sparse = shard_tables(model, ctx, cfg, device)
        ignored |= set(model.sparse.parameters())
    if cfg.parallel.ep > 1:
        from gemctl.parallel.expert import build_groups, shard_experts

        out.expert_groups = build_groups(ctx.world_size, ctx.rank, cfg.parallel.ep)
        out.expert_params = shard_experts(model, out.expert_groups)
        ignored |= set(out.expert_params)
    out.checkpoint = apply_activation_checkpointing(model, cfg.parallel.activation_checkpoint, device)
    _compile(model, cfg, out)
    apply_fsdp(model, ctx.mesh, cfg.precision, device, formats, ignored_params=ignored or None)
    return out


def _compile(model, cfg, out: Parallelized) -> None:
    if cfg.parallel.compile:
        from gemctl.parallel.compile import apply_compile

        out.compiled_layers = apply_compile(model)


__all__ = ["CheckpointPlan", "ParallelContext", "init_parallel", "parallelize", "apply_fsdp"]
