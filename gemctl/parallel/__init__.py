"""Parallel layouts: the device mesh from the layout, and `parallelize`, which applies them to the
model in one fixed order (STYLE.md, after torchtitan's parallelize):

    1. sparse sharding      - not yet: embedding tables are sharded by FSDP like dense rows
    2. activation checkpointing - not yet
    3. torch.compile        - not yet
    4. FSDP2 / HSDP          - every dense block, then the root (gemctl.parallel.dense)
"""

from gemctl.parallel.dense import apply_fsdp
from gemctl.parallel.mesh import ParallelContext, init_parallel


def parallelize(model, ctx: ParallelContext, precision_cfg, device, formats: dict[str, str]):
    """Apply the layout of ``ctx`` to ``model`` (in place); a process outside torchrun is left as
    it is."""
    if ctx.sharded:
        apply_fsdp(model, ctx.mesh, precision_cfg, device, formats)
    return model


__all__ = ["ParallelContext", "init_parallel", "parallelize", "apply_fsdp"]
