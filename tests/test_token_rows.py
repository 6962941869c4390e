"""Token rows past the last offset (model.token_multiple pads the history to whole multiples):
the attention ops give them zero outputs and zero gradients and leave the sequences' rows as
they are, on the reference and on the Triton kernels; the model's loss and gradients are those of
the unpadded batch; MoE routes only the sequences' rows; the config field is checked."""

import dataclasses

import pytest
import torch

from gemctl import ops
from gemctl.config.compose import compose
from gemctl.config.validate import validate
from gemctl.data.synthetic import SyntheticSource
from gemctl.errors import ConfigError
from gemctl.model import build_model
from gemctl.model.gem import pad_token_rows, token_rows
from gemctl.model.moe import MoEMLP

# hostile lengths: empty sequences first, between and last; one row; a tile (16) +- 1
LENGTHS = [0, 1, 17, 0, 15, 33, 0]
EXTRA = 9  # rows past the last offset


def _offsets(lengths, device):
    host = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    return ops.host.register(host.to(device), host)


def _operands(rows, heads, dim, device, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, heads, dim, generator=g) * 0.5).to(device, dtype).requires_grad_() for _ in range(3)]


def _calls(device):
    """op name -> (q rows, k rows, call(q, k, v)) with padding rows on every jagged side."""
    off = _offsets(LENGTHS, device)
    n = sum(LENGTHS)
    fixed = _offsets([3] * len(LENGTHS), device)  # PMA queries / cross-attention keys: 3 per sample
    nf = 3 * len(LENGTHS)
    return n, {
        "jagged_attention": (n, n, lambda q, k, v, be: ops.jagged_attention(
            q, k, v, off, off, max(LENGTHS), max(LENGTHS), causal=True, backend=be)),
        "gdpa_cross": (n, nf, lambda q, k, v, be: ops.gdpa(q, k, v, off, fixed, max(LENGTHS), 3, backend=be)),
        "gdpa_pma": (nf, n, lambda q, k, v, be: ops.gdpa(q, k, v, fixed, off, 3, max(LENGTHS), backend=be)),
        "block_attention": (n, n, lambda q, k, v, be: ops.block_attention(
            q, k, v, off, max(LENGTHS), block_size=16, backend=be)),
    }


def _check_padding_rows(backend, device, dtype, atol):
    n, calls = _calls(device)
    for name, (nq, nk, call) in calls.items():
        jagged_q, jagged_k = nq == n, nk == n
        q = _operands(nq + EXTRA * jagged_q, 2, 32, device, dtype, 0)[0]
        k, v = _operands(nk + EXTRA * jagged_k, 2, 32, device, dtype, 1)[:2]
        out = call(q, k, v, backend)
        assert out.shape[0] == q.shape[0], name
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(device, dtype)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
        if jagged_q:
            assert torch.count_nonzero(out[nq:]) == 0 and torch.count_nonzero(dq[nq:]) == 0, name
        if jagged_k:
            assert torch.count_nonzero(dk[nk:]) == 0 and torch.count_nonzero(dv[nk:]) == 0, name
        # the sequences' rows: as the same op on the unpadded operands
        q0, k0, v0 = (t.detach()[:r].clone().requires_grad_() for t, r in ((q, nq), (k, nk), (v, nk)))
        out0 = call(q0, k0, v0, backend)
        g0 = torch.autograd.grad(out0, (q0, k0, v0), grad[:nq])
        torch.testing.assert_close(out[:nq], out0, atol=atol, rtol=0, msg=name)
        for got, want in zip((dq[:nq], dk[:nk], dv[:nk]), g0):
            torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=name)


def test_padding_rows_reference():
    _check_padding_rows("torch", "cpu", torch.float64, 1e-12)


def test_padding_rows_triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    _check_padding_rows("triton", "cpu", torch.float32, 1e-5)


@pytest.mark.gpu
def test_padding_rows_triton_gpu():
    _check_padding_rows("triton", "cuda", torch.bfloat16, 2e-2)


def test_fewer_rows_than_the_offsets_is_an_error():
    off = _offsets([4, 3], "cpu")
    q6, k6, v6 = _operands(6, 2, 32, "cpu", torch.float32, 0)
    q7, k7, v7 = _operands(7, 2, 32, "cpu", torch.float32, 1)
    with pytest.raises(ValueError, match="q has 6 rows, fewer than the 7"):
        ops.jagged_attention(q6, k7, v7, off, off, 4, 4, backend="torch")
    with pytest.raises(ValueError, match="k has 6 rows, fewer than the 7"):
        ops.block_attention(q7, k6, v7, off, 4, block_size=16, backend="torch")
    with pytest.raises(ValueError, match="v has 6 rows, fewer than the 7"):
        ops.gdpa(q7, k7, v6, off, off, 4, 4, backend="torch")


def test_token_rows_rule():
    assert token_rows(0, 1024, torch.device("cpu")) == 0
    assert token_rows(1, 1024, torch.device("cpu")) == 1024
    assert token_rows(2048, 1024, torch.device("cpu")) == 2048
    assert token_rows(2049, None, torch.device("cuda")) == 3072  # the CUDA default
    assert token_rows(2049, None, torch.device("cpu")) == 2049  # off on the CPU
    assert token_rows(5, 1, torch.device("cpu")) == 5
    x = torch.randn(5, 3)
    assert pad_token_rows(x, 1) is x
    p = pad_token_rows(x, 4)
    assert p.shape == (8, 3) and torch.equal(p[:5], x) and torch.count_nonzero(p[5:]) == 0


def _loss_and_grads(overrides, multiple, device="cpu"):
    cfg = compose(list(overrides) + [f"model.token_multiple={multiple}"])
    src = SyntheticSource(cfg.data)
    torch.manual_seed(0)
    model = build_model(cfg.model, src.spec, device=torch.device(device)).double() if device == "cpu" else \
        build_model(cfg.model, src.spec, device=torch.device(device))
    batch = src.train_batch(3)
    if device == "cpu":  # float64 throughout (torchrec's tables stay float32: their outputs are cast)
        batch = dataclasses.replace(batch, dense=batch.dense.double())
        lookup = model.sparse.forward
        model.sparse.forward = lambda b: tuple(t.double() for t in lookup(b))
    else:
        batch = batch.to(torch.device(device))
    logits = model(batch)
    loss = logits.float().square().mean() + (model.aux_loss() or 0.0)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad], allow_unused=True)
    return batch, loss.detach(), dict(zip(names, grads))


@pytest.mark.parametrize("overrides", [[], ["model.attention=[full,block:8]"], ["model.moe.n_experts=4"]],
                         ids=["full", "block", "moe"])
def test_padded_model_is_the_unpadded_model(overrides):
    """token_multiple 64 on the CPU (the batch's tokens are not a multiple of it): same loss, same
    gradients, in float64, as with no padding."""
    batch, loss1, g1 = _loss_and_grads(overrides, 1)
    assert batch.num_tokens % 64, "the batch must need padding for this test to check it"
    _, loss64, g64 = _loss_and_grads(overrides, 64)
    torch.testing.assert_close(loss64, loss1, rtol=1e-10, atol=0)
    for name, g in g1.items():
        if g is None:
            assert g64[name] is None, name
        else:
            torch.testing.assert_close(g64[name], g, rtol=1e-9, atol=1e-12, msg=name)


def test_moe_routes_only_the_sequences_rows():
    torch.manual_seed(0)
    m = MoEMLP(8, 16, 4, 2).double()
    x = torch.randn(13, 8, dtype=torch.float64)
    full = m(x[:10])
    aux = m.aux_loss.clone()
    padded = m(x, rows=10)
    assert torch.equal(padded[:10], full) and torch.count_nonzero(padded[10:]) == 0
    assert torch.equal(m.aux_loss, aux)


@pytest.mark.parametrize("value", [0, -1024])
def test_token_multiple_must_be_positive(value):
    with pytest.raises(ConfigError, match="model.token_multiple"):
        validate(compose([f"model.token_multiple={value}"]), check_device=False)


@pytest.mark.gpu
def test_padded_model_matches_on_the_gpu_kernels_gpu():
    """On CUDA (Triton kernels, fp32 weights): the default padding (1024) against none."""
    torch.backends.cuda.matmul.allow_tf32 = False
    _, loss1, g1 = _loss_and_grads(["train.device=cuda"], 1, "cuda")
    _, loss_d, g_d = _loss_and_grads(["train.device=cuda"], "null", "cuda")
    torch.testing.assert_close(loss_d, loss1, rtol=1e-5, atol=0)
    for name, g in g1.items():
        if g is not None:
            torch.testing.assert_close(g_d[name], g, rtol=1e-3, atol=1e-5, msg=name)
