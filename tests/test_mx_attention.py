"""MXFP8 attention (precision.mx.attention): the QK^T and PV operands MX-quantized along their
contraction axes, gradients straight through; the PyTorch reference and the Triton kernel (the
probabilities quantized in-kernel; the CPU tier under the interpreter)."""

from __future__ import annotations

import pytest
import torch

from gemctl import ops
from gemctl.precision.mx import mx_qdq
from gemctl.precision.mx_linear import MXRecipe, mx_attention_quant

LENGTHS = [0, 1, 33, 70, 31]  # MX blocks of 32 keys must restart at every sequence


def _inputs(lengths, heads=2, dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int64)
    n = int(offsets[-1])
    q, k, v = (torch.randn(n, heads, dim, generator=g) * s for s in (1.5, 1.5, 1.0))
    return q, k, v, offsets, max(lengths)


def _per_sequence(q, k, v, offsets, causal, quant):
    """float64 attention per sequence; with quant, the operands MX-quantized per sequence (q, k along
    the head dim; v along its keys from the sequence's first key; p along the keys)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(offsets.numel() - 1):
        s0, s1 = int(offsets[b]), int(offsets[b + 1])
        if s1 == s0:
            continue
        qb, kb, vb = q[s0:s1], k[s0:s1], v[s0:s1]
        if quant:
            qb, kb, vb = (mx_qdq(t, 32, axis=a, scale_rule="rceil") for t, a in ((qb, -1), (kb, -1), (vb, 0)))
        s = torch.einsum("qhd,khd->hqk", qb.double(), kb.double()) * q.shape[-1] ** -0.5
        if causal:
            n = s1 - s0
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        if quant:  # before normalization, relative to the row maximum rounded up in log2 units
            s2 = s * 1.4426950408889634
            pt = torch.exp2(s2 - torch.ceil(s2.amax(-1, keepdim=True)))
            p = mx_qdq(pt.float(), 32, axis=-1, scale_rule="rceil").double() / pt.sum(-1, keepdim=True)
        else:
            p = torch.softmax(s, -1)
        out[s0:s1] = torch.einsum("hqk,khd->qhd", p, vb.double())
    return out


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("causal", [False, True])
def test_mx_operands_match_per_sequence_reference(causal):
    q, k, v, offsets, max_len = _inputs(LENGTHS)
    quant = mx_attention_quant(MXRecipe(scale_rule="rceil"))
    got = ops.jagged_attention(q, k, v, offsets, offsets, max_len, max_len, causal=causal, backend="torch",
                               operand_quant=quant)
    want = _per_sequence(q, k, v, offsets, causal, quant=True)
    exact = _per_sequence(q, k, v, offsets, causal, quant=False)
    # Quantized as the per-sequence reference quantizes (float32 against float64: 3e-8 measured),
    # and measurably not the unquantized attention (~6%).
    assert _rel(got, want) < 1e-5
    assert _rel(got, exact) > 5 * _rel(got, want)


def test_mx_operands_gradients_pass_straight_through():
    q, k, v, offsets, max_len = _inputs(LENGTHS, seed=1)
    grads = []
    for quant in (mx_attention_quant(MXRecipe(scale_rule="rceil")), None):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ops.jagged_attention(*leaves, offsets, offsets, max_len, max_len, causal=True, backend="torch",
                                   operand_quant=quant)
        out.backward(torch.ones_like(out))
        grads.append([t.grad for t in leaves])
    for g_mx, g_ref in zip(*grads):
        assert torch.isfinite(g_mx).all() and 0 < _rel(g_mx, g_ref.double()) < 0.2


def _kernel_vs_reference(lengths, causal, window, with_bias, recipe, device="cpu", dtype=torch.float32, forced=None,
                         backends=("torch", "triton")):
    from gemctl.ops.triton import common

    q, k, v, offsets, max_len = _inputs(lengths, seed=2)
    table = torch.randn(2, 16, generator=torch.Generator().manual_seed(3)) * 0.5 if with_bias else None
    quant = mx_attention_quant(recipe)
    results = {}
    for backend in backends:
        leaves = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
        tb = table.to(device).requires_grad_() if table is not None else None
        bias = ops.RelativePositionBias(tb, 40) if tb is not None else None
        with common.forced_config(forced or {}):
            out = ops.jagged_attention(*leaves, offsets.to(device), offsets.to(device), max_len, max_len, bias=bias,
                                       causal=causal, window=window, backend=backend, operand_quant=quant)
            grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(device, dtype)
            results[backend] = [out, *torch.autograd.grad(out, leaves + ([tb] if tb is not None else []), grad)]
    return results


@pytest.mark.parametrize("causal, window, with_bias, recipe", [
    (False, None, False, MXRecipe(scale_rule="rceil")),
    (True, None, True, MXRecipe(scale_rule="floor")),
    (True, 20, True, MXRecipe(elem=torch.float8_e5m2, scale_rule="rceil")),
    (False, 7, False, MXRecipe(elem=torch.float8_e5m2, scale_rule="floor")),
])
@pytest.mark.parametrize("transposed", [0, 1])
def test_triton_kernel_matches_the_reference_cpu(causal, window, with_bias, recipe, transposed):
    """The kernel quantizes P in-kernel relative to an integer running maximum (exact under MX,
    which commutes with powers of two) and its backward reproduces the reference's straight-through
    gradients: outputs, dq, dk, dv and the bias gradient agree to float32 rounding."""
    got = _kernel_vs_reference([0, 1, 33, 70, 31, 64], causal, window, with_bias, recipe,
                               forced={"dkdv": (16, 32, 1, 1, transposed)})
    for name, a, b in zip(["out", "dq", "dk", "dv", "dbias"], got["triton"], got["torch"]):
        assert torch.isfinite(a).all(), name
        assert _rel(a, b.double()) < 1e-5, name


@pytest.mark.gpu
@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (True, 256)])
def test_triton_kernel_matches_the_reference_gpu(causal, window):
    """bf16 on the GPU, against the reference in float32 on the same quantized numerics: within
    2x the bf16 reference path's own error (plus a floor)."""
    lengths = [0, 1, 63, 64, 65, 700, 3, 130]
    recipe = MXRecipe(scale_rule="rceil")
    got = _kernel_vs_reference(lengths, causal, window, True, recipe, "cuda", torch.bfloat16)
    want = _kernel_vs_reference(lengths, causal, window, True, recipe, "cuda", torch.float32,
                                backends=("torch",))["torch"]
    for name, a, b, w in zip(["out", "dq", "dk", "dv", "dbias"], got["triton"], got["torch"], want):
        assert torch.isfinite(a).all(), name
        assert _rel(a, w.double()) <= 2 * _rel(b, w.double()) + 2e-3, name


def test_non_mx_quantizers_refuse_the_triton_backend():
    q, k, v, offsets, max_len = _inputs([3])
    with pytest.raises(ValueError, match="blocks of 32"):
        ops.jagged_attention(q, k, v, offsets, offsets, max_len, max_len, backend="triton",
                             operand_quant=lambda t, axis: t)
    with pytest.raises(ValueError, match="blocks of 32"):
        ops.jagged_attention(q, k, v, offsets, offsets, max_len, max_len, backend="triton",
                             operand_quant=mx_attention_quant(MXRecipe(block=16)))


@pytest.mark.parametrize("attention", [True, False])
def test_recipe_routes_mx_attention(attention):
    from gemctl.config.compose import compose
    from gemctl.data.source import build_source
    from gemctl.model import build_model
    from gemctl.precision.rules import apply_precision

    cfg = compose(["model=tiny", "precision=mxfp8_safe", "train.device=cpu", f"precision.mx.attention={attention}"])
    source = build_source(cfg.data, cfg.shuffle, 1, 0)
    model = build_model(cfg.model, source.spec, device=torch.device("cpu"))
    apply_precision(model, cfg.precision, cfg.model.num_layers, "cpu")
    quantized = [layer.attn.operand_quant is not None for layer in model.tower.layers]
    # mxfp8_safe keeps the last tower layer in bf16: its attention stays unquantized too
    assert quantized == [attention] * (cfg.model.num_layers - 1) + [False]
    with torch.no_grad():
        assert torch.isfinite(model(source.train_batch(0))).all()


def test_mx_attention_with_block_layers_is_a_config_error():
    from gemctl.config.compose import compose
    from gemctl.config.validate import validate
    from gemctl.errors import ConfigError

    cfg = compose(["model=tiny", "precision=mxfp8", "precision.mx.attention=true", "model.attention=[full,block:16]"])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert err.value.field == "precision.mx.attention" and "block:16" in str(err.value)


def test_triton_kernel_compiles_without_graph_break_cpu():
    """MXFP8 attention through the kernel under torch.compile(fullgraph): the operand quantizers,
    the per-sequence padding of v and the custom op (with its mx_p argument and row-maximum output)
    trace; forward and gradients match eager."""
    q, k, v, offsets, max_len = _inputs([3, 0, 40], seed=5)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    quant = mx_attention_quant(MXRecipe(scale_rule="rceil"))

    def f(q, k, v):
        out = ops.jagged_attention(q, k, v, offsets, offsets, max_len, max_len, causal=True, backend="triton",
                                   operand_quant=quant)
        return out.square().sum()

    ops.preload()  # as the trainer does on CUDA: the kernel module is imported before tracing
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss, ref = compiled(q, k, v), f(q, k, v)
    assert torch.allclose(loss, ref)
    for a, b in zip(torch.autograd.grad(loss, [q, k, v]), torch.autograd.grad(ref, [q, k, v])):
        assert torch.allclose(a, b)
