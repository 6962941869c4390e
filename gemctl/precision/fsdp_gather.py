r"""Quantized FSDP2 all-gather of Linear weights: the machinery shared by the mxfp8
(gemctl.precision.mx_fsdp) and fp8 (gemctl.precision.fp8_fsdp) formats.

FSDP2 shards W [N, K] (out-features N, in-features K) by rows. A low-precision linear quantizes W
along the contraction axis of each GEMM: along K (axis 1) for the forward, along N (axis 0) for
the dgrad. ``QuantizedGatherWeight`` wraps the fp32 master so that FSDP2's all-gather extension
hooks quantize the local row shard along the axis the coming GEMM needs (axis 1 for the forward
all-gather, axis 0 for the backward re-gather of a unit that resharded after forward) and
all-gather those bytes; after the gather the weight is dequantized to the unit's parameter dtype.
A format subclass says how: ``quantize_shard`` (the all-gather inputs and metadata of one local
shard), ``dequantize`` (the gathered weight) and ``can_gather`` (whether its shards quantize
exactly as the whole weight does, with the same byte counts in both gathers: FSDP2 allocates its
all-gather outputs once, at the first gather).

The wrapper is a tensor subclass around the master: every op runs on the wrapped tensor; the ops
FSDP2 uses to shard, pad and view a parameter return the subclass again so the local shard keeps
the all-gather hooks. Saving a tensor (``torch.save``) writes the plain tensor.

Uses the hooks' five-argument ``fsdp_pre_all_gather(mesh, orig_size, contiguous_orig_stride,
module, mp_policy)`` and ``fsdp_post_all_gather(..., *, out=None)``, and reads the owning unit's
FSDP2 training state (a private attribute) to tell the backward re-gather from the forward
all-gather; checked with torch 2.13.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

aten = torch.ops.aten

# Ops FSDP2 (sharding, padding, views, state loading) and DTensor apply to a parameter whose
# result is the same parameter's data: these return the subclass, everything else a plain tensor.
_PRESERVE = {
    aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
    aten.as_strided.default, aten.slice.Tensor, aten.narrow.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.chunk.default, aten.empty_like.default, aten.new_zeros.default,
    aten.new_empty.default, aten.new_empty_strided.default, aten.clone.default, aten._to_copy.default,
    aten._pin_memory.default,
}


def _in_place(func) -> bool:
    """An aten op that mutates its first argument and returns it (copy_, add_, ...)."""
    schema = func._schema
    return bool(schema.arguments) and schema.arguments[0].is_write and not schema.name.startswith("aten::_foreach")


class QuantizedGatherWeight(torch.Tensor):
    """A weight whose FSDP2 all-gather carries a quantization of its local shard (see the module
    docstring); subclasses implement ``quantize_shard``, ``dequantize`` and ``can_gather``."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, recipe):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            layout=data.layout, device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor, recipe):
        self._data = data
        self._recipe = recipe

    def __repr__(self):
        return f"{type(self).__name__}({self._data!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        recipe = None

        def unwrap(t):
            nonlocal recipe
            recipe = t._recipe
            return t._data

        inner_args, inner_kwargs = pytree.tree_map_only(cls, unwrap, (args, kwargs or {}))
        out = func(*inner_args, **inner_kwargs)
        if func in _PRESERVE:
            return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, recipe), out)
        if _in_place(func) and args and isinstance(args[0], cls):
            return args[0]
        return out

    def __tensor_flatten__(self):
        return ["_data"], self._recipe

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, recipe, outer_size, outer_stride):
        return cls(inner_tensors["_data"], recipe)

    def __reduce_ex__(self, protocol):
        return self._data.__reduce_ex__(protocol)  # checkpoints hold the plain master weight

    # What a format defines ---------------------------------------------------------------------

    def quantize_shard(self, mesh, axis: int) -> tuple[tuple[torch.Tensor, ...], tuple]:
        """The all-gather inputs of the local shard ``self._data`` quantized along ``axis`` (each
        a tensor whose rows are the shard's share), and the metadata ``dequantize`` gets on this
        rank (its first entry the axis); ``mesh`` is the shard group FSDP2 passes."""
        raise NotImplementedError

    def dequantize(self, all_gather_outputs, metadata, dtype: torch.dtype) -> torch.Tensor:
        """The gathered weight [N, K] in ``dtype`` from the gathered inputs."""
        raise NotImplementedError

    @classmethod
    def can_gather(cls, weight: torch.Tensor, shard_size: int, recipe) -> bool:
        """Whether ``weight``'s shards over ``shard_size`` ranks gather exactly (see the format's limits)."""
        raise NotImplementedError

    # FSDP2 all-gather extension ------------------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        """The local row shard quantized along in-features (forward) or along out-features (the
        backward re-gather)."""
        return self.quantize_shard(mesh, 0 if _in_backward(module) else 1)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The gathered weight dequantized to ``param_dtype``."""
        with torch.no_grad():
            weight = self.dequantize(all_gather_outputs, metadata, param_dtype)
            if out is not None:
                # FSDP2 refills the same unsharded parameter on every all-gather (its storage was
                # freed at reshard); autograd saved it in the forward, so its version must not move.
                with torch.autograd._unsafe_preserve_version_counter(out):
                    out.copy_(weight)
                return None
        return weight, (weight,)

    @classmethod
    def wrap(cls, linear: torch.nn.Linear, unit: torch.nn.Module, recipe) -> None:
        """Replace ``linear.weight`` by a parameter of this class (same values, same
        requires_grad); ``unit`` is the module ``fully_shard`` is applied to (its training state
        tells the forward all-gather from the backward one). Call before ``fully_shard(unit)``."""
        w = linear.weight
        linear.weight = torch.nn.Parameter(cls(w.detach(), recipe), requires_grad=w.requires_grad)
        object.__setattr__(linear, "_fsdp_gather_unit", unit)  # a reference, not a registered submodule


def _in_backward(module) -> bool:
    """Whether the FSDP2 unit that owns ``module`` is gathering for the backward."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    unit = getattr(module, "_fsdp_gather_unit", None)
    if unit is None:
        raise RuntimeError("QuantizedGatherWeight: the module has no FSDP unit recorded (QuantizedGatherWeight.wrap "
                           "sets it)")
    group = unit._get_fsdp_state()._fsdp_param_group
    return group is not None and group._training_state == TrainingState.PRE_BACKWARD


def shards_into_whole_blocks(weight: torch.Tensor, shard_size: int, block: int) -> bool:
    """Whether W [N, K] splits evenly over ``shard_size`` ranks into shards of whole ``block``-value
    blocks along both axes (a multiple of ``block`` rows per rank, K a multiple of ``block``)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        return False
    n, k = weight.shape
    return n % shard_size == 0 and (n // shard_size) % block == 0 and k % block == 0
