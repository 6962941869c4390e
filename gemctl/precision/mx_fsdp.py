r"""MX all-gather of FSDP2-sharded mxfp8 Linear weights: each rank MX-quantizes its local shard
and FSDP2 all-gathers the FP8 element bytes and the E8M0 scale bytes instead of the master
weight, so the all-gather moves 1 + 1/32 bytes per element instead of 4 (fp32) or 2 (bf16).

FSDP2 shards W [M, K] (out-features M, in-features K) by rows. The MX linear
(gemctl.precision.mx_linear) quantizes W twice, each time along the contraction axis of one GEMM:

    forward  y  = x  @ W^T   W blocked along K (axis 1): rows are independent, any row shard
                             quantizes exactly as the whole matrix does
    dgrad    dx = gy @ W     W blocked along M (axis 0): a row shard whose length is a multiple
                             of the block holds whole blocks and quantizes exactly too

so the all-gather of the forward carries the axis-1 quantization and the re-gather of the
backward (``reshard_after_forward=True`` units only) carries the axis-0 quantization; both have
M*K element bytes and M*K/32 scale bytes. After the all-gather the weight is dequantized to the
unit's parameter dtype (fp32 on CPU, bf16 on CUDA), and the MX linear's own quantization of that
tensor along the same axis returns the same values (an MX-representable tensor is a fixed point
of quantize-then-dequantize under both scale rules; see ``requantize_is_identity``), so forward
and dgrad see exactly the values the unsharded MX linear computes from the fp32 master. The
gradient of the unsharded weight, its reduce-scatter and the optimizer step on the sharded fp32
master are unchanged.

``MXGatherWeight`` is a wrapper tensor subclass around the fp32 master: every op runs on the
wrapped tensor; the ops FSDP2 uses to shard, pad and view a parameter return the subclass again
so the local shard keeps the all-gather hooks. Saving a tensor (``torch.save``) writes the plain
tensor.

Limits: only weights of units that reshard after forward are wrapped (FSDP2 keeps the root and
the last block gathered between forward and backward, and their dgrad would need the axis-0
quantization as well); M must split evenly over the shard group with a multiple of the block per
rank and K must be a multiple of the block (both gathers then have the same byte sizes, as FSDP2
allocates its all-gather outputs once). Other weights keep the ordinary all-gather.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from gemctl.precision.mx import dequantize_mx, quantize_mx

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


class MXGatherWeight(torch.Tensor):
    """A weight whose FSDP2 all-gather carries its MX quantization (see the module docstring)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, recipe):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            layout=data.layout, device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor, recipe):
        self._data = data
        self._recipe = recipe

    def __repr__(self):
        return f"MXGatherWeight({self._data!r})"

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

    @staticmethod
    def __tensor_unflatten__(inner_tensors, recipe, outer_size, outer_stride):
        return MXGatherWeight(inner_tensors["_data"], recipe)

    def __reduce_ex__(self, protocol):
        return self._data.__reduce_ex__(protocol)  # checkpoints hold the plain master weight

    # FSDP2 all-gather extension ------------------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        """The local row shard quantized along in-features (forward) or along out-features (the
        backward re-gather): (E4M3/E5M2 bytes as uint8, E8M0 scales), and the axis."""
        axis = 0 if _in_backward(module) else 1
        r = self._recipe
        data, scale = quantize_mx(self._data, r.block, r.elem, axis=axis, scale_rule=r.scale_rule)
        return (data.view(torch.uint8), scale), (axis,)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The gathered MX weight dequantized to ``param_dtype``."""
        data, scale = all_gather_outputs
        (axis,) = metadata
        r = self._recipe
        with torch.no_grad():
            weight = dequantize_mx(data.view(r.elem), scale, r.block, axis=axis, dtype=param_dtype)
            if out is not None:
                # FSDP2 refills the same unsharded parameter on every all-gather (its storage was
                # freed at reshard); autograd saved it in the forward, so its version must not move.
                with torch.autograd._unsafe_preserve_version_counter(out):
                    out.copy_(weight)
                return None
        return weight, (weight,)


def _in_backward(module) -> bool:
    """Whether the FSDP2 unit that owns ``module`` is gathering for the backward."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    unit = getattr(module, "_mx_fsdp_unit", None)
    if unit is None:
        raise RuntimeError("MXGatherWeight: the module has no FSDP unit recorded (wrap_mx_weight sets it)")
    group = unit._get_fsdp_state()._fsdp_param_group
    return group is not None and group._training_state == TrainingState.PRE_BACKWARD


def can_gather_mx(weight: torch.Tensor, shard_size: int, block: int) -> bool:
    """Whether W [M, K] shards into whole MX blocks along both axes (see the module's limits)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        return False
    m, k = weight.shape
    return m % shard_size == 0 and (m // shard_size) % block == 0 and k % block == 0


def wrap_mx_weight(linear: torch.nn.Linear, unit: torch.nn.Module, recipe) -> None:
    """Replace ``linear.weight`` by an ``MXGatherWeight`` parameter (same values, same
    requires_grad); ``unit`` is the module ``fully_shard`` is applied to (its training state tells
    the forward all-gather from the backward one). Call before ``fully_shard(unit)``."""
    w = linear.weight
    linear.weight = torch.nn.Parameter(MXGatherWeight(w.detach(), recipe), requires_grad=w.requires_grad)
    object.__setattr__(linear, "_mx_fsdp_unit", unit)  # a reference, not a registered submodule


def requantize_is_identity(data: torch.Tensor, scale: torch.Tensor, recipe, axis: int,
                           dtype: torch.dtype = torch.float32) -> bool:
    """Whether quantize(dequantize(q)) dequantizes to the same values as q (the MX linear's
    re-quantization of a gathered weight changes nothing)."""
    w = dequantize_mx(data, scale, recipe.block, axis=axis, dtype=dtype)
    d2, s2 = quantize_mx(w, recipe.block, recipe.elem, axis=axis, scale_rule=recipe.scale_rule)
    return torch.equal(dequantize_mx(d2, s2, recipe.block, axis=axis, dtype=dtype), w)
