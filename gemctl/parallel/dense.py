"""FSDP2 over the dense model: each block (cross-attention, every sequence-tower layer, PMA,
interaction, task heads) is one fully_shard unit, then the root takes the rest (projections,
feature tokens and, for now, the embedding tables, sharded by rows like any parameter).

On a 1-D layout (dp_replicate = 1) this is FSDP over dp_shard; on a 2-D mesh it is HSDP: shard
inside each dp_shard group, all-reduce gradients across the dp_replicate groups. On CUDA with
bf16 compute, parameters are gathered in bf16 and gradients reduced in fp32, except in units that
hold an fp32 layer of the precision recipe; CPU runs fp32.

With ``precision.mx.fsdp_gather`` (default true), the weights of mxfp8 Linears in units that
reshard after forward are all-gathered MX-quantized (1 byte per element plus one E8M0 scale per
32): gemctl.precision.mx_fsdp.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def dense_blocks(model):
    """The modules that become their own FSDP unit, in forward order."""
    return [model.cross, *model.tower.layers, model.pma, model.interaction, model.heads]


def unit_param_dtypes(model, formats: dict[str, str], device_type: str, compute_dtype: str) -> dict[str, torch.dtype]:
    """Gathered-parameter dtype per FSDP unit ('root' for the rest): bf16 where the unit computes
    in bf16 on CUDA; fp32 where any of its modules is an fp32 layer of the precision recipe (its
    forward runs outside autocast and needs fp32 weights), and on CPU."""
    names = {id(m): n for n, m in model.named_modules()}
    units = {names[id(b)]: b for b in dense_blocks(model)}
    low = device_type == "cuda" and compute_dtype == "bf16"

    def owner(path: str) -> str:
        return next((u for u in units if path == u or path.startswith(u + ".")), "root")

    dtypes = {u: torch.bfloat16 if low else torch.float32 for u in [*units, "root"]}
    for path, fmt in formats.items():
        if fmt == "fp32":
            dtypes[owner(path)] = torch.float32
    return dtypes


def wrap_mx_gather_weights(model, blocks, formats: dict[str, str], precision_cfg, shard_size: int,
                           ignored_params=None) -> list[str]:
    """Wrap the weights of the mxfp8 Linears in ``blocks`` whose shards hold whole MX blocks
    (gemctl.precision.mx_fsdp), before fully_shard; returns their module paths."""
    mx_cfg = getattr(precision_cfg, "mx", None)
    if "mxfp8" not in formats.values() or not getattr(mx_cfg, "fsdp_gather", True):
        return []
    from gemctl.precision.mx_fsdp import can_gather_mx, wrap_mx_weight
    from gemctl.precision.mx_linear import MXRecipe

    recipe = MXRecipe.from_config(mx_cfg)
    ignored = {id(p) for p in ignored_params or ()}
    names = {id(m): n for n, m in model.named_modules()}
    wrapped = []
    for block in blocks:
        for sub, module in block.named_modules():
            path = f"{names[id(block)]}.{sub}" if sub else names[id(block)]
            if (formats.get(path) == "mxfp8" and isinstance(module, nn.Linear) and id(module.weight) not in ignored
                    and can_gather_mx(module.weight, shard_size, recipe.block)):
                wrap_mx_weight(module, block, recipe)
                wrapped.append(path)
    return wrapped


def apply_fsdp(model, mesh, precision_cfg, device, formats: dict[str, str], ignored_params=None) -> list[str]:
    """fully_shard every dense block, then the root; returns the paths of the Linears whose weights
    are all-gathered MX-quantized."""
    mesh = mesh if mesh.size(0) > 1 else mesh["dp_shard"]
    dtypes = unit_param_dtypes(model, formats, device.type, precision_cfg.compute_dtype)
    names = {id(m): n for n, m in model.named_modules()}

    def policy(unit: str) -> MixedPrecisionPolicy:
        if dtypes[unit] == torch.float32:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=dtypes[unit], reduce_dtype=torch.float32, cast_forward_inputs=False)

    blocks = dense_blocks(model)
    # Units that reshard after forward (all but the last block; the root keeps its parameters
    # gathered too): their backward re-gathers, so each gather carries the one MX blocking its
    # GEMM needs.
    mx_gathered = wrap_mx_gather_weights(model, blocks[:-1], formats, precision_cfg, mesh.size(mesh.ndim - 1),
                                         ignored_params)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed right away by the backward: keep them gathered.
        fully_shard(block, mesh=mesh, mp_policy=policy(names[id(block)]), reshard_after_forward=i < len(blocks) - 1,
                    ignored_params=ignored_params)
    # Parameters already split by another layout (torchrec tables, expert-parallel experts) are left
    # out of every unit (ignored_params): they are not replicas FSDP could shard.
    fully_shard(model, mesh=mesh, mp_policy=policy("root"), ignored_params=ignored_params)
    return mx_gathered
