r"""FP8 all-gather of FSDP2-sharded fp8 Linear weights: each rank quantizes its local shard as the
fp8 format (gemctl.precision.fp8_linear) will, and FSDP2 all-gathers the E4M3 element bytes and
the E8M0 scale bytes instead of the master weight: 1 byte per element plus one per scale group
(``precision.fp8.granularity``: row, one per row of K values; block128 / mx32, one per 128 / 32
values) instead of 4 (fp32) or 2 (bf16).

FSDP2 shards W [N, K] (out-features N, in-features K) by rows. The fp8 linear quantizes W along
the contraction axis of each GEMM, E4M3 elements with power-of-two scales under RCEIL, in groups
of ``group`` values (0: the whole axis):

    forward  y  = x  W^T   W along K (axis 1): rows are independent, any row shard quantizes
                           exactly as the whole matrix does; scales [N_shard, K / group] (row: [N_shard, 1])
    dgrad    dx = gy W     W along N (axis 0):
                           block128 / mx32: a shard of a multiple of ``group`` rows holds whole
                           groups and quantizes exactly; scales [N_shard / group, K]
                           row: one scale per column of W over all N rows, which no shard holds:
                           the ranks all-reduce (MAX) their column amax over the shard group (the
                           int32 bits of |W|, exact and NaN-ordered like quantize_mx; K * 4 bytes)
                           and quantize their rows with the global scales [1, K]

The forward all-gather carries the axis-1 quantization, the backward re-gather
(``reshard_after_forward=True`` units only) the axis-0 one. FSDP2 sizes its all-gather buffers at
the first gather, so both gathers move the same bytes: for group granularities N_shard * K / group
scale bytes either way; for row, the backward keeps the forward's N_shard-byte scale slot (unused,
zeros) and passes the global column scales, the same on every rank after the all-reduce, to the
post-gather hook as metadata instead of gathering them. After the gather the weight is
dequantized to the unit's parameter dtype (fp32 on CPU, bf16 on CUDA), and the fp8 linear's own
quantization of that tensor along the same axis returns the same values (a quantized tensor is a
fixed point of quantize-then-dequantize under RCEIL; see ``requantize_is_identity``), so forward
and dgrad see exactly the values the unsharded fp8 linear computes from the fp32 master. The fused
MLP block (``use_fp8_mlp``) reads ``mlp.up.weight`` and ``mlp.down.weight`` at call time, so
wrapping those Linears' weights covers it too. Gradients, their reduce-scatter and the optimizer
step on the sharded fp32 master are unchanged.

``Fp8GatherWeight`` is the fp8 format of the wrapper in gemctl.precision.fsdp_gather (the tensor
subclass and the FSDP2 hooks, shared with the MX format).

Limits: not with ``precision.fp8.hadamard`` (the linear quantizes the rotated W R; those weights
gather in the unit's dtype); only with ``precision.fp8.dgrad: fp8`` (an unquantized dgrad needs W itself in the
backward); only weights of units that reshard after forward are wrapped (FSDP2 keeps the root and
the last block gathered between forward and backward, and their dgrad would need the axis-0
quantization as well); N must split evenly over the shard group and, for block128 / mx32, hold a
multiple of the group per rank with K a multiple of the group. Other weights keep the ordinary
all-gather. The row format's backward re-gather adds one K-element int32 all-reduce per weight
(issued from the pre-all-gather hook, in the same order on every rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gemctl.precision.fsdp_gather import QuantizedGatherWeight, shards_into_whole_blocks
from gemctl.precision.mx import dequantize_mx, quantize_mx

E4M3 = torch.float8_e4m3fn


def column_amax_bits(t: torch.Tensor) -> torch.Tensor:
    """[1, K] int32: the largest |t| bits of every column (NaN patterns order above inf, as in
    quantize_mx), the quantity the ranks all-reduce with MAX."""
    return (t.float().view(torch.int32) & 0x7FFFFFFF).amax(0, keepdim=True)


def quantize_fp8(t: torch.Tensor, group: int, axis: int, amax_bits: torch.Tensor | None = None):
    """E4M3 bytes and E8M0 scales of ``t`` [R, K] along ``axis`` in groups of ``group`` values
    (0: the whole axis), RCEIL: the operand quantization of gemctl.precision.fp8_linear.qdq.
    ``amax_bits`` (axis 0, group 0 only): a [1, K] column amax over more rows than ``t`` holds
    (all shards'); the columns are scaled by it instead of by their local amax."""
    if amax_bits is not None:
        if axis != 0 or group != 0:
            raise ValueError("quantize_fp8: amax_bits is for whole-column scales (axis 0, group 0)")
        # A witness row holding the global amax raises each column's amax to it; the rows of t
        # then quantize with the global scales, through quantize_mx's own rounding.
        t = torch.cat([t.float(), amax_bits.view(torch.float32)])
    block = max(t.shape[axis], 1) if group == 0 else group
    data, scale = quantize_mx(t, block, E4M3, axis=axis, scale_rule="rceil")
    return (data[:-1], scale) if amax_bits is not None else (data, scale)


def dequantize_fp8(data: torch.Tensor, scale: torch.Tensor, group: int, axis: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    block = max(data.shape[axis], 1) if group == 0 else group
    return dequantize_mx(data, scale, block, axis=axis, dtype=dtype)


class Fp8GatherWeight(QuantizedGatherWeight):
    """A weight whose FSDP2 all-gather carries its fp8 quantization (see the module docstring);
    the recipe is gemctl.precision.fp8_linear.Fp8Recipe."""

    def quantize_shard(self, mesh, axis: int):
        """(E4M3 bytes as uint8, E8M0 scales); metadata (axis, the global column scales of the
        row format's backward re-gather or None)."""
        group = self._recipe.group
        local = self._data  # [N_shard, K]
        if axis == 0 and group == 0:
            amax_bits = column_amax_bits(local)
            # FSDP2 passes the shard mesh (HSDP: the dp_shard dimension), 1-D.
            dist.all_reduce(amax_bits, op=dist.ReduceOp.MAX, group=mesh.get_group(mesh.ndim - 1))
            data, column_scale = quantize_fp8(local, 0, 0, amax_bits)
            unused = torch.zeros(local.shape[0], 1, dtype=torch.uint8, device=local.device)  # the forward's slot
            return (data.view(torch.uint8), unused), (axis, column_scale)
        data, scale = quantize_fp8(local, group, axis)
        return (data.view(torch.uint8), scale), (axis, None)

    def dequantize(self, all_gather_outputs, metadata, dtype: torch.dtype) -> torch.Tensor:
        data, scale = all_gather_outputs
        axis, column_scale = metadata
        if column_scale is not None:
            scale = column_scale
            if scale.is_cuda:  # made on FSDP2's copy-in stream, read here on the current one
                scale.record_stream(torch.cuda.current_stream(scale.device))
        return dequantize_fp8(data.view(E4M3), scale, self._recipe.group, axis, dtype)

    @classmethod
    def can_gather(cls, weight: torch.Tensor, shard_size: int, recipe) -> bool:
        # dgrad: bf16 multiplies by W itself, which the backward re-gather must then carry unquantized;
        # with a Hadamard rotation the linear quantizes W R, not W, so a quantized W gathers wrong values
        return recipe.dgrad == "fp8" and not recipe.hadamard and can_gather_fp8(weight, shard_size, recipe.group)


def can_gather_fp8(weight: torch.Tensor, shard_size: int, group: int) -> bool:
    """Whether W [N, K] shards so that each rank quantizes exactly (see the module's limits)."""
    return shards_into_whole_blocks(weight, shard_size, group or 1)


def requantize_is_identity(data: torch.Tensor, scale: torch.Tensor, group: int, axis: int,
                           dtype: torch.dtype = torch.float32) -> bool:
    """Whether the fp8 linear's quantize-dequantize (fp8_linear.qdq) of the dequantized weight
    returns it unchanged (its re-quantization of a gathered weight changes nothing)."""
    from gemctl.precision.fp8_linear import qdq

    w = dequantize_fp8(data, scale, group, axis, dtype)
    return torch.equal(qdq(w, group, axis).to(dtype), w)
