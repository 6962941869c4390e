"""Parallel layouts: the device mesh from the layout, and `parallelize`, which applies them to the
model in one fixed order (STYLE.md, after torchtitan's parallelize):

    1. sparse sharding      - parallel.sparse.sharding=torchrec: DistributedModelParallel over the
                              tables (gemctl.parallel.sparse); fsdp: tables are FSDP row shards
    2. activation checkpointing - not yet
    3. torch.compile        - not yet
    4. FSDP2 / HSDP          - every dense block, then the root (gemctl.parallel.dense)
"""

from gemctl.parallel.dense import apply_fsdp
from gemctl.parallel.mesh import ParallelContext, init_parallel


def parallelize(model, ctx: ParallelContext, cfg, device, formats: dict[str, str]):
    """Apply the layout of ``ctx`` to ``model`` (in place); a process outside torchrun is left as
    it is. Returns (the torchrec table plan, the fused optimizer of the tables) or (None, None)."""
    fused = tables = None
    if ctx.sharded and cfg.parallel.sparse.sharding == "torchrec":
        from gemctl.parallel.sparse import shard_tables

        tables, fused = shard_tables(model, ctx, cfg, device)
    if ctx.sharded:
        ignored = set(model.sparse.parameters()) if fused is not None else None
        apply_fsdp(model, ctx.mesh, cfg.precision, device, formats, ignored_params=ignored)
    return tables, fused


__all__ = ["ParallelContext", "init_parallel", "parallelize", "apply_fsdp"]
