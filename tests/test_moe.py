"""Mixture-of-experts MLP: dispatch against a per-token float64 loop (values and gradients), the
load-balancing loss by hand, its FLOPs against torch's counter, and training with it."""

import pytest
import torch
import torch.nn.functional as F

from gemctl.config.compose import compose
from gemctl.config.validate import validate
from gemctl.model.moe import MoEMLP


def _loop(m: MoEMLP, x: torch.Tensor) -> torch.Tensor:
    """out_i = sum over the token's top-k experts of gate x expert(x_i), one token at a time."""
    gates, experts, _ = m.route(x)
    rows = []
    for i in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=x.dtype)
        for g, e in zip(gates[i], experts[i]):
            acc = acc + g.to(x.dtype) * (F.silu(x[i] @ m.up[e]) @ m.down[e])
        rows.append(acc)
    return torch.stack(rows) if rows else x * 0


@pytest.mark.parametrize("n,experts,k", [(0, 4, 2), (1, 4, 1), (37, 4, 2), (64, 8, 3), (5, 3, 3)])
def test_dispatch_matches_the_loop(n, experts, k):
    torch.manual_seed(n + experts)
    m = MoEMLP(16, 32, experts, k).double()
    x = torch.randn(n, 16, dtype=torch.float64, requires_grad=True)
    got = m(x)
    ref = _loop(m, x)
    assert torch.allclose(got, ref, atol=1e-12)
    if n:
        g = torch.randn_like(got)
        grads = torch.autograd.grad(got, [x, m.up, m.down, m.router.weight], g)
        ref_grads = torch.autograd.grad(ref, [x, m.up, m.down, m.router.weight], g)
        for a, b in zip(grads, ref_grads):
            assert torch.allclose(a, b, atol=1e-10)


def test_load_balancing_loss_by_hand():
    m = MoEMLP(4, 8, 4, 2)
    with torch.no_grad():
        m.router.weight.zero_()  # uniform probabilities: aux = sum_e f_e = 1 whatever the choice
    m(torch.randn(10, 4))
    assert m.aux_loss.item() == pytest.approx(1.0)
    with torch.no_grad():  # every token prefers experts 0 and 1 with probability ~1/2 each
        m.router.weight.copy_(torch.tensor([[50.0, 0, 0, 0], [50.0, 0, 0, 0], [-50.0, 0, 0, 0], [-50.0, 0, 0, 0]]))
    m(torch.ones(10, 4))
    # f = (1/2, 1/2, 0, 0), P = (1/2, 1/2, 0, 0): aux = 4 x (1/4 + 1/4) = 2
    assert m.aux_loss.item() == pytest.approx(2.0, rel=1e-6)


def test_moe_flops_count_router_and_top_k_experts():
    """Per token: the router GEMM and top_k expert MLPs (the torch-counter check of every GEMM,
    MoE included, is in test_flops.py)."""
    import torch as t

    from gemctl.data.synthetic import SyntheticSource
    from gemctl.metrics import flops

    cfg = compose(["data.batch_size=8", "model.moe.n_experts=4", "model.moe.top_k=2"])
    src = SyntheticSource(cfg.data)
    lengths = t.tensor([3, 0, 5])
    fc = flops.gem_flops(cfg.model, src.spec, lengths)
    m = cfg.model
    assert fc.forward["tower.router"] == m.num_layers * 2 * 8 * m.d_model * 4
    assert fc.forward["tower.mlp"] == m.num_layers * 2 * 2 * (2 * 8 * m.d_model * m.mlp_ratio * m.d_model)


def test_training_with_moe(tmp_path):
    from gemctl.train.trainer import train

    cfg = compose(["model.moe.n_experts=4", "train.steps=6", "train.warmup_timing_steps=1", "train.log_every=3",
                   "data.synthetic.eval_samples=64", "data.eval_batch_size=64", "run.progress=false"])
    validate(cfg)
    result = train(cfg, run_root=str(tmp_path))
    assert len(result.losses) == 6 and all(torch.isfinite(torch.tensor(result.losses)))


def test_bad_top_k():
    from gemctl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model.moe.top_k: must be in \[1, model.moe.n_experts=4\], got 5"):
        validate(compose(["model.moe.n_experts=4", "model.moe.top_k=5"]))
