"""Per-layer precision rules.

A recipe is an ordered list of rules ``{match, format, last_n_layers}``; for every module path of
the model (``tower.layers.3.mlp.up``) the last rule whose fnmatch pattern matches, and whose
``last_n_layers`` (if set) covers the module's sequence-tower layer, decides its format. A
module with no matching rule inherits its parent's format; the root runs in the recipe's
``compute_dtype``. Formats: ``bf16`` (autocast on CUDA), ``fp32`` (autocast turned off inside
the module, inputs upcast) and ``mxfp8``: an ``nn.Linear`` whose format is mxfp8 runs its GEMMs
through the MX linear (gemctl.precision.mx_linear, options from ``precision.mx``); ``fp8``:
an ``nn.Linear`` runs its GEMMs on FP8 tensor cores (gemctl.precision.fp8_linear, options from
``precision.fp8``), and an MLP block whose ``up`` and ``down`` are both fp8 runs as one fused FP8
MLP. Any other module with a low-precision format computes like bf16 (its Linear descendants
inherit the format unless a rule says otherwise).
"""

from __future__ import annotations

import fnmatch
import functools
import re

import torch
from torch import nn

_LAYER = re.compile(r"^tower\.layers\.(\d+)(\.|$)")


def _rule_applies(rule, path: str, num_layers: int) -> bool:
    if not fnmatch.fnmatchcase(path, rule.match):
        return False
    if rule.last_n_layers is None:
        return True
    m = _LAYER.match(path)
    return bool(m) and int(m.group(1)) >= num_layers - rule.last_n_layers


def resolve_formats(model: nn.Module, precision_cfg, num_layers: int) -> dict[str, str]:
    """Module path -> format for every module ('' is the root)."""
    formats: dict[str, str] = {}
    for path, _ in model.named_modules():
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        fmt = formats.get(parent, precision_cfg.compute_dtype) if path else precision_cfg.compute_dtype
        for rule in precision_cfg.rules:
            if path and _rule_applies(rule, path, num_layers):
                fmt = rule.format
        formats[path] = fmt
    return formats


def _fp32_forward(forward, device_type: str):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        args = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        with torch.autocast(device_type=device_type, enabled=False):
            return forward(*args, **kwargs)

    return run


def _apply_fp8(model: nn.Module, formats: dict[str, str], fp8_cfg) -> None:
    from gemctl.model.norm import RMSNorm
    from gemctl.model.sequence import MLP, SequenceLayer
    from gemctl.precision.fp8_linear import Fp8Recipe, use_fp8_linear, use_fp8_mlp

    recipe = Fp8Recipe.from_config(fp8_cfg)
    # A sequence layer's pre-norms (RMSNorm with a weight) fuse into the first cast of what follows
    # them: the FP8 MLP, and the QKV projection (unless MX attention quantizes its operands).
    pre_norms = {}
    for m in model.modules():
        if isinstance(m, SequenceLayer):
            pairs = [(m.mlp, m.mlp_norm)]
            if getattr(m.attn, "operand_quant", None) is None:
                pairs.append((m.attn.qkv, m.attn_norm))
            pre_norms.update({id(target): norm for target, norm in pairs
                              if isinstance(norm, RMSNorm) and norm.weight is not None})
    fused: set[str] = set()
    for path, module in model.named_modules():
        if isinstance(module, MLP) and isinstance(module.act, nn.SiLU):
            up, down = f"{path}.up" if path else "up", f"{path}.down" if path else "down"
            if formats.get(up) == formats.get(down) == "fp8" and module.up.bias is None and module.down.bias is None:
                use_fp8_mlp(module, recipe, norm=pre_norms.get(id(module)) if recipe.fused_mlp else None)
                fused.update((up, down))
    for path, module in model.named_modules():
        if formats[path] == "fp8" and isinstance(module, nn.Linear) and path not in fused:
            use_fp8_linear(module, recipe, norm=pre_norms.get(id(module)) if recipe.fused_qkv_norm else None)


def apply_precision(model: nn.Module, precision_cfg, num_layers: int, device_type: str) -> dict[str, str]:
    """Make the top-most fp32 modules run outside autocast, the mxfp8 Linears run through the MX
    linear and the fp8 ones on FP8 GEMMs; returns the resolved formats."""
    formats = resolve_formats(model, precision_cfg, num_layers)
    if "mxfp8" in formats.values():
        from gemctl.model.attention import JaggedSelfAttention
        from gemctl.precision.mx_linear import MXRecipe, use_mx_attention, use_mx_linear

        recipe = MXRecipe.from_config(getattr(precision_cfg, "mx", None))
        for path, module in model.named_modules():
            if formats[path] == "mxfp8" and isinstance(module, nn.Linear):
                use_mx_linear(module, recipe)
            elif (recipe.attention and isinstance(module, JaggedSelfAttention) and module.kind != "block"
                  and formats.get(f"{path}.qkv") == "mxfp8"):
                use_mx_attention(module, recipe)
    if "fp8" in formats.values():
        _apply_fp8(model, formats, getattr(precision_cfg, "fp8", None))
    covered: set[str] = set()  # modules that already run inside a wrapped fp32 forward
    for path, module in model.named_modules():
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        if path and parent in covered:
            covered.add(path)
        elif path and formats[path] == "fp32" and not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            # ModuleList / ModuleDict containers are indexed, never called: wrapping their
            # forward would do nothing, so their children are wrapped instead.
            module.forward = _fp32_forward(module.forward, device_type)
            covered.add(path)
    return formats
