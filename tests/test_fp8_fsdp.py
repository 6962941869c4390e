"""FP8 all-gather of FSDP2-sharded fp8 weights (gemctl.precision.fp8_fsdp) on CPU with gloo.

Two processes (tests/fsdp_ranks.py, as tests/test_mx_fsdp.py) shard the tiny GemModel with
apply_fsdp under ``precision=fp8`` and count what FSDP2 all-gathers: an fp8-gathered weight moves
1 byte per element plus its E8M0 scales (row: one per row of the shard; mx32: one per 32
elements), every other parameter its fp32 bytes. ``model.interaction_rank=63`` gives the
interaction layers' V a 63-row weight, which does not split over 2 ranks (and U 63 in-features,
not whole 32-value groups): those fall back to the ordinary all-gather. A few training steps with
the fp8 all-gather give bit-identical losses to the ordinary fp32 all-gather, for the row and the
mx32 granularity, and the gathered weights are exactly the fp8 linear's quantize-dequantize of
the whole master weight, along both axes (the row format's backward through the all-reduced
column amax), on FSDP and on HSDP (a 2 x 2 mesh).
"""

from __future__ import annotations

import pytest
import torch
from fsdp_ranks import STEPS, spawn

from gemctl.precision.fp8_fsdp import (
    Fp8GatherWeight,
    can_gather_fp8,
    column_amax_bits,
    quantize_fp8,
    requantize_is_identity,
)
from gemctl.precision.fp8_linear import GRANULARITIES, Fp8Recipe

FP8 = ["precision=fp8", "model.interaction_rank=63"]
GROUP_GRANULARITY = "mx32"


@pytest.fixture(scope="module")
def runs():
    """Two ranks, the four variants one after the other."""
    group = FP8 + [f"precision.fp8.granularity={GROUP_GRANULARITY}"]
    return spawn({
        "row": FP8,
        "row_off": FP8 + ["precision.fp8.fsdp_gather=false"],
        "group": group,
        "group_off": group + ["precision.fp8.fsdp_gather=false"],
    })


@pytest.fixture(scope="module")
def hsdp():
    """Four ranks: 2 replicas of 2 shards; the column amax is all-reduced over the shard group."""
    return spawn({"row": FP8}, mesh_shape=(2, 2))


RESHARDED = [  # the fp8 Linears of units that reshard after forward (not the root, not the heads)
    "cross.attn.q", "cross.attn.kv", "cross.attn.out",
    *[f"tower.layers.{i}.{m}" for i in range(2) for m in ("attn.qkv", "attn.out", "mlp.up", "mlp.down")],
    "pma.attn.q", "pma.attn.kv", "pma.attn.out",
    "interaction.proj", *[f"interaction.layers.{i}.{m}" for i in range(2) for m in ("v", "u")],
]
FALLBACK = {  # V [63, 64]: 63 rows do not split over 2 ranks; U [64, 63]: 63 is not whole 32-groups
    "row": {"interaction.layers.0.v", "interaction.layers.1.v"},
    "group": {"interaction.layers.0.v", "interaction.layers.1.v", "interaction.layers.0.u", "interaction.layers.1.u"},
}
# Measured per rank and step (the docstring of test_fp8_all_gather_payload): the fp8-gathered
# weights' bytes (fwd = bwd), the elements they hold, and all the all-gathers' input bytes
# (forward, backward) with the fp8 gather on and off.
MEASURED = {
    "row": {"fp8_bytes": 86880, "elements": 85952, "on": (1895784, 105440), "off": (2152712, 362368)},
    "group": {"fp8_bytes": 84480, "elements": 81920, "on": (1909512, 119168), "off": (2152712, 362368)},
}


@pytest.mark.parametrize("granularity", ["row", "group"])
def test_fp8_all_gather_payload(runs, granularity):
    """Per rank and step on the tiny model (2 ranks, interaction_rank 63):
    row: 17 fp8-gathered weights, 85,952 elements, 86,880 bytes (1 per element + 928 row scales)
    instead of 343,808 fp32, in the forward and again in the backward re-gather, whose row-scale
    slot goes unused while the 1,918 column scales come from a 7,672-byte int32 all-reduce of the
    column amax; all the forward's all-gathers carry 1,895,784 bytes instead of 2,152,712, the
    backward's 105,440 instead of 362,368.
    mx32: 15 weights (U falls back too), 81,920 elements, 84,480 bytes (1 + 1/32 per element)
    instead of 327,680; forward 1,909,512, backward 119,168; no all-reduce."""
    for rank, res in runs[granularity].items():
        assert sorted(res["wrapped"]) == sorted(set(RESHARDED) - FALLBACK[granularity])
        # What fsdp_pre_all_gather returns: uint8 element bytes (1 per element) and uint8 E8M0
        # scales (row: one per local row, in both gathers; mx32: one per 32 elements), the
        # forward quantized along in-features, the backward along out-features.
        assert res["pre"]
        for phase, shape, axis, parts in res["pre"]:
            numel = shape[0] * shape[1]
            scales = shape[0] if granularity == "row" else numel // 32
            assert parts == [(torch.uint8, numel), (torch.uint8, scales)]
            assert axis == (1 if phase == "fwd" else 0)
        per_phase = {ph: sum(sum(n for _, n in parts) for p, _, _, parts in res["pre"] if p == ph) // STEPS
                     for ph in ("fwd", "bwd")}  # per step
        elements = sum(shape[0] * shape[1] for p, shape, _, _ in res["pre"] if p == "fwd") // STEPS
        assert per_phase["fwd"] == per_phase["bwd"] == MEASURED[granularity]["fp8_bytes"]
        assert elements == MEASURED[granularity]["elements"]
        # What the all-gather collectives carried: exactly the expected bytes, every step.
        for step in res["payload"]:
            assert step == (res["expected"]["fwd"], res["expected"]["bwd"]) == MEASURED[granularity]["on"]
        # The row format's backward all-reduces 4 bytes per in-feature of each wrapped weight.
        for step in res["all_reduce"]:
            assert step == (0, res["expected_all_reduce"]["bwd"])
        assert res["expected_all_reduce"]["bwd"] == (7672 if granularity == "row" else 0)
        off = runs[f"{granularity}_off"][rank]
        assert off["wrapped"] == [] and off["pre"] == []
        assert off["payload"][0] == (off["expected"]["fwd"], off["expected"]["bwd"]) == MEASURED[granularity]["off"]
        saved = 4 * elements - per_phase["fwd"]  # the same weights as fp32 shards, minus fp8
        assert off["payload"][0][0] - res["payload"][0][0] == off["payload"][0][1] - res["payload"][0][1] == saved


@pytest.mark.parametrize("granularity", ["row", "group"])
def test_fp8_gather_trains_bit_identically(runs, granularity):
    """The gathered weight is exactly the fp8 linear's quantization of the whole master (forward
    along K, dgrad along N), so the losses equal those of the ordinary fp32 all-gather bit for bit."""
    on, off = runs[granularity], runs[f"{granularity}_off"]
    assert on[0]["losses"] == on[1]["losses"] == off[0]["losses"]
    assert len(on[0]["losses"]) == STEPS and all(torch.isfinite(torch.tensor(on[0]["losses"])))
    for res in on.values():
        assert len(res["exact"]) == len(res["wrapped"])
        assert all(fwd and bwd for fwd, bwd in res["exact"].values()), res["exact"]


def test_fp8_gather_on_hsdp(hsdp):
    """HSDP: FSDP2 passes the dp_shard mesh to the hook; the column amax is all-reduced over it
    and every replica's gathered weights are the whole master's quantization. Per rank the same
    bytes as FSDP on 2 ranks (each shard group holds 2 ranks)."""
    for res in hsdp["row"].values():
        assert sorted(res["wrapped"]) == sorted(set(RESHARDED) - FALLBACK["row"])
        assert all(fwd and bwd for fwd, bwd in res["exact"].values()), res["exact"]
        assert res["payload"] == [MEASURED["row"]["on"]] * STEPS
        assert res["all_reduce"] == [(0, 7672)] * STEPS
    losses = [res["losses"] for res in hsdp["row"].values()]
    assert all(lo == losses[0] for lo in losses) and all(torch.isfinite(torch.tensor(losses[0])))


# ----------------------------------------------------------------------------------------------
# Single-process checks of the pieces.


def _weight(rows: int = 256, cols: int = 256) -> torch.Tensor:
    """Columns spanning six decades, a zero row, and an element whose group maximum rounds to 224
    (RCEIL's scale then halves on re-quantization: the values must not move)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, cols)
    w[5] = 0.0
    w[7] = torch.randn(cols, generator=g) * 1e-2
    w[:, 40] = torch.randn(rows, generator=g) * 1e-2
    w[7, 40] = 8.0 * 224.5  # scale 2^3 along either axis (the rest of its row and column is small)
    return w


def _quantize_sharded(w: torch.Tensor, group: int, axis: int, shards: int):
    """What the ranks gather: each row shard quantized, the row format's dgrad with the all-reduced
    (here: max over the shards) column amax."""
    parts = w.chunk(shards)
    amax = None
    if axis == 0 and group == 0:
        amax = torch.stack([column_amax_bits(p) for p in parts]).amax(0)
    quantized = [quantize_fp8(p, group, axis, amax) for p in parts]
    data = torch.cat([d for d, _ in quantized])
    scale = quantized[0][1] if amax is not None else torch.cat([s for _, s in quantized])
    if amax is not None:  # every shard computed the same global scales
        assert all(torch.equal(s, scale) for _, s in quantized)
    return data, scale


@pytest.mark.parametrize("granularity", list(GRANULARITIES))
@pytest.mark.parametrize("axis", [0, 1])
def test_sharded_quantization_equals_whole_and_is_a_fixed_point(granularity, axis):
    """Row shards (2 of 128 rows: whole groups of every granularity) quantize to the bytes and scales of the whole weight, and the fp8
    linear's quantize-dequantize (fp8_linear.qdq) of the dequantized weight returns it unchanged,
    in float32 and in bf16 (the parameter dtype on CUDA)."""
    group = GRANULARITIES[granularity]
    w = _weight()
    whole = quantize_fp8(w, group, axis)
    data, scale = _quantize_sharded(w, group, axis, 2)
    assert torch.equal(data.view(torch.uint8), whole[0].view(torch.uint8)) and torch.equal(scale, whole[1])
    assert requantize_is_identity(data, scale, group, axis)
    assert requantize_is_identity(data, scale, group, axis, dtype=torch.bfloat16)


def test_column_scales_need_the_global_amax():
    """A shard's own column amax gives other scales than the whole column's (why the row format's
    backward all-reduces it)."""
    w = _weight()
    local = quantize_fp8(w[:128], 0, 0)
    assert not torch.equal(local[1], quantize_fp8(w, 0, 0)[1])
    with pytest.raises(ValueError, match="axis 0, group 0"):
        quantize_fp8(w, 32, 0, column_amax_bits(w))


def test_can_gather_fp8():
    assert can_gather_fp8(torch.empty(6, 10), 2, 0)  # row: any even split
    assert not can_gather_fp8(torch.empty(63, 64), 2, 0)  # uneven rows
    assert can_gather_fp8(torch.empty(128, 64), 2, 32)
    assert not can_gather_fp8(torch.empty(64, 64), 4, 32)  # 16 rows per rank: not whole groups along N
    assert not can_gather_fp8(torch.empty(64, 63), 2, 32)  # K not a multiple of the group
    assert not can_gather_fp8(torch.empty(128, 128), 2, 128)  # 64 rows per rank
    assert Fp8GatherWeight.can_gather(torch.empty(256, 128), 2, Fp8Recipe(granularity="block128"))
    assert not Fp8GatherWeight.can_gather(torch.empty(256, 128), 2, Fp8Recipe(dgrad="bf16"))  # needs W itself
    assert not Fp8GatherWeight.can_gather(torch.empty(256, 128), 2, Fp8Recipe(hadamard=64))  # quantizes W R


def test_wrapper_keeps_its_class_through_fsdp_views():
    p = torch.nn.Parameter(Fp8GatherWeight(torch.randn(64, 32), Fp8Recipe()))
    assert isinstance(p.detach().view(-1)[:10], Fp8GatherWeight) and p.dtype == torch.float32
