"""FSDP2 over the dense model: each block (cross-attention, every sequence-tower layer, PMA,
interaction, task heads) is one fully_shard unit, then the root takes the rest (projections,
feature tokens and, for now, the embedding tables, sharded by rows like any parameter).

On a 1-D layout (dp_replicate = 1) this is FSDP over dp_shard; on a 2-D mesh it is HSDP: shard
inside each dp_shard group, all-reduce gradients across the dp_replicate groups. On CUDA with
bf16 compute, parameters are gathered in bf16 and gradients reduced in fp32; CPU runs fp32.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def dense_blocks(model):
    """The modules that become their own FSDP unit, in forward order."""
    return [model.cross, *model.tower.layers, model.pma, model.interaction, model.heads]


def apply_fsdp(model, mesh, precision_cfg, device) -> None:
    mesh = mesh if mesh.size(0) > 1 else mesh["dp_shard"]
    policy = MixedPrecisionPolicy()
    if device.type == "cuda" and precision_cfg.compute_dtype == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    blocks = dense_blocks(model)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed right away by the backward: keep them gathered.
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy)
