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

``MXGatherWeight`` is the MX format of the wrapper in gemctl.precision.fsdp_gather (the tensor
subclass and the FSDP2 hooks, shared with the fp8 format).

Limits: only weights of units that reshard after forward are wrapped (FSDP2 keeps the root and
the last block gathered between forward and backward, and their dgrad would need the axis-0
quantization as well); M must split evenly over the shard group with a multiple of the block per
rank and K must be a multiple of the block (both gathers then have the same byte sizes, as FSDP2
allocates its all-gather outputs once). Other weights keep the ordinary all-gather.
"""

from __future__ import annotations

import torch

from gemctl.precision.fsdp_gather import QuantizedGatherWeight, shards_into_whole_blocks
from gemctl.precision.mx import dequantize_mx, quantize_mx

can_gather_mx = shards_into_whole_blocks  # (weight, shard_size, block): whole MX blocks along both axes


class MXGatherWeight(QuantizedGatherWeight):
    """A weight whose FSDP2 all-gather carries its MX quantization (see the module docstring)."""

    def quantize_shard(self, mesh, axis: int):
        """(E4M3/E5M2 bytes as uint8, E8M0 scales), and the axis."""
        r = self._recipe
        data, scale = quantize_mx(self._data, r.block, r.elem, axis=axis, scale_rule=r.scale_rule)
        return (data.view(torch.uint8), scale), (axis,)

    def dequantize(self, all_gather_outputs, metadata, dtype: torch.dtype) -> torch.Tensor:
        data, scale = all_gather_outputs
        (axis,) = metadata
        r = self._recipe
        return dequantize_mx(data.view(r.elem), scale, r.block, axis=axis, dtype=dtype)

    @classmethod
    def can_gather(cls, weight: torch.Tensor, shard_size: int, recipe) -> bool:
        return can_gather_mx(weight, shard_size, recipe.block)


def requantize_is_identity(data: torch.Tensor, scale: torch.Tensor, recipe, axis: int,
                           dtype: torch.dtype = torch.float32) -> bool:
    """Whether quantize(dequantize(q)) dequantizes to the same values as q (the MX linear's
    re-quantization of a gathered weight changes nothing)."""
    w = dequantize_mx(data, scale, recipe.block, axis=axis, dtype=dtype)
    d2, s2 = quantize_mx(w, recipe.block, recipe.elem, axis=axis, scale_rule=recipe.scale_rule)
    return torch.equal(dequantize_mx(d2, s2, recipe.block, axis=axis, dtype=dtype), w)
