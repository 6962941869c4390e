"""FSDP2 over the dense model: each block (cross-attention, every sequence-tower layer, PMA,
interaction, task heads) is one fully_shard unit, then the root takes the rest (projections,
feature tokens and, for now, the embedding tables, sharded by rows like any parameter).

On a 1-D layout (dp_replicate = 1) this is FSDP over dp_shard; on a 2-D mesh it is HSDP: shard
inside each dp_shard group, all-reduce gradients across the dp_replicate groups. On CUDA with
bf16 compute, parameters are gathered in bf16 and gradients reduced in fp32, except in units that
hold an fp32 layer of the precision recipe; CPU runs fp32.

With ``precision.mx.fsdp_gather`` (default true), the weights of mxfp8 Linears in units that
reshard after forward are all-gathered MX-quantized (1 byte per element plus one E8M0 scale per
32): gemctl.precision.mx_fsdp; with ``precision.fp8.fsdp_gather`` (default true) those of fp8
Linears FP8-quantized (1 byte per element plus one scale per row or group):
gemctl.precision.fp8_fsdp.
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


def _quantized_gathers(formats: dict[str, str], precision_cfg) -> dict:
    """Format -> (the weight wrapper class, its recipe) for the formats present in ``formats``
    whose all-gather is quantized (``precision.<mx|fp8>.fsdp_gather``)."""
    gathers = {}
    mx_cfg = getattr(precision_cfg, "mx", None)
    if "mxfp8" in formats.values() and getattr(mx_cfg, "fsdp_gather", True):
        from gemctl.precision.mx_fsdp import MXGatherWeight
        from gemctl.precision.mx_linear import MXRecipe

        gathers["mxfp8"] = MXGatherWeight, MXRecipe.from_config(mx_cfg)
    fp8_cfg = getattr(precision_cfg, "fp8", None)
    if "fp8" in formats.values() and getattr(fp8_cfg, "fsdp_gather", True):
        from gemctl.precision.fp8_fsdp import Fp8GatherWeight
        from gemctl.precision.fp8_linear import Fp8Recipe

        gathers["fp8"] = Fp8GatherWeight, Fp8Recipe.from_config(fp8_cfg)
    return gathers


def wrap_quantized_gather_weights(model, blocks, formats: dict[str, str], precision_cfg, shard_size: int,
                                  ignored_params=None) -> list[str]:
    """Wrap the weights of the mxfp8 and fp8 Linears in ``blocks`` whose shards quantize exactly
    (gemctl.precision.mx_fsdp, gemctl.precision.fp8_fsdp), before fully_shard; returns their
    module paths."""
    gathers = _quantized_gathers(formats, precision_cfg)
    if not gathers:
        return []
    ignored = {id(p) for p in ignored_params or ()}
    names = {id(m): n for n, m in model.named_modules()}
    wrapped = []
    for block in blocks:
        for sub, module in block.named_modules():
            path = f"{names[id(block)]}.{sub}" if sub else names[id(block)]
            gather = gathers.get(formats.get(path))
            if gather is None or not isinstance(module, nn.Linear) or id(module.weight) in ignored:
                continue
            weight_class, recipe = gather
            if weight_class.can_gather(module.weight, shard_size, recipe):
                weight_class.wrap(module, block, recipe)
                wrapped.append(path)
    return wrapped


def apply_fsdp(model, mesh, precision_cfg, device, formats: dict[str, str], ignored_params=None) -> list[str]:
    """fully_shard every dense block, then the root; returns the paths of the Linears whose weights
    are all-gathered quantized (mxfp8 or fp8)."""
    mesh = mesh if mesh.size(0) > 1 else mesh["dp_shard"]
    dtypes = unit_param_dtypes(model, formats, device.type, precision_cfg.compute_dtype)
    names = {id(m): n for n, m in model.named_modules()}

    def policy(unit: str) -> MixedPrecisionPolicy:
        if dtypes[unit] == torch.float32:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=dtypes[unit], reduce_dtype=torch.float32, cast_forward_inputs=False)

    blocks = dense_blocks(model)
    # Units that reshard after forward (all but the last block; the root keeps its parameters
    # gathered too): their backward re-gathers, so each gather carries the one quantization its
    # GEMM needs.
    gathered = wrap_quantized_gather_weights(model, blocks[:-1], formats, precision_cfg, mesh.size(mesh.ndim - 1),
                                             ignored_params)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed right away by the backward: keep them gathered.
        fully_shard(block, mesh=mesh, mp_policy=policy(names[id(block)]), reshard_after_forward=i < len(blocks) - 1,
                    ignored_params=ignored_params)
    # Parameters already split by another layout (torchrec tables, expert-parallel experts) are left
    # out of every unit (ignored_params): they are not replicas FSDP could shard.
    fully_shard(model, mesh=mesh, mp_policy=policy("root"), ignored_params=ignored_params)
    return gathered
