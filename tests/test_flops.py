"""The FLOP counter: hand-computed cases and a check of every GEMM against torch's counter."""

import pytest
import torch

from gemctl.config.compose import compose
from gemctl.data.synthetic import SyntheticSource
from gemctl.metrics import flops
from gemctl.metrics.mfu import Peak, e2e_mfu, lookup_peak, mfu
from gemctl.model import build_model

L = torch.tensor


def test_gemm():
    assert flops.gemm(3, 4, 5) == 120


@pytest.mark.parametrize(
    "lq,lk,causal,expected",
    [
        ([0, 3, 5], [0, 3, 5], False, 0 + 9 + 25),
        ([3], [3], True, 6),  # 1 + 2 + 3
        ([5, 0, 1], [5, 0, 1], True, 15 + 0 + 1),
        ([2], [5], True, 4 + 5),  # last query aligned with the last key: sees 0..3, then 0..4
        ([5], [2], True, 0 + 0 + 0 + 1 + 2),  # three queries see no key at all
        ([4], [0], True, 0),
        ([0], [7], True, 0),
        ([3, 2], [1, 4], False, 3 + 8),
    ],
)
def test_attention_pairs_by_hand(lq, lk, causal, expected):
    assert flops.attention_pairs(L(lq), L(lk), causal) == expected


def test_attention_pairs_match_the_reference_mask():
    gen = torch.Generator().manual_seed(0)
    lq = torch.randint(0, 40, (50,), generator=gen)
    lk = torch.randint(0, 40, (50,), generator=gen)
    brute = 0
    for a, b in zip(lq.tolist(), lk.tolist()):
        i = torch.arange(a)[:, None]
        j = torch.arange(b)[None, :]
        brute += int(((i + b - a - j) >= 0).sum())
    assert flops.attention_pairs(lq, lk, causal=True) == brute


@pytest.mark.parametrize("causal", [True, False])
def test_window_pairs_match_the_reference_mask(causal):
    gen = torch.Generator().manual_seed(1)
    lengths = torch.cat([torch.randint(0, 40, (30,), generator=gen), L([0, 1, 7, 8, 9])])
    for window in (1, 2, 8, 100):
        brute = 0
        for n in lengths.tolist():
            d = torch.arange(n)[:, None] - torch.arange(n)[None, :]
            brute += int((((d >= 0) if causal else (d > -window)) & (d < window)).sum())
        assert flops.window_attention_pairs(lengths, window, causal) == brute, window


def test_block_pairs():
    assert flops.block_attention_pairs(L([130, 0, 64, 1]), 64) == (64 * 64 * 2 + 4) + 0 + 4096 + 1


def _tiny(overrides=()):
    cfg = compose(list(overrides))
    return cfg, SyntheticSource(cfg.data)


def test_gem_attention_flops_by_hand():
    cfg, src = _tiny()
    m = cfg.model
    lengths = L([0, 3])
    fc = flops.gem_flops(m, src.spec, lengths)
    n_ns = len(src.spec.sparse_features) + 1
    per_pair = 4 * m.num_heads * m.head_dim
    assert fc.forward["tower.attention"] == per_pair * m.num_layers * 6  # causal 3x3 triangle per layer
    assert fc.forward["cross.attention"] == per_pair * 3 * n_ns
    assert fc.forward["pma.attention"] == per_pair * m.pma_queries * 3
    assert fc.train_total == 3 * fc.forward_total
    # Padding never counts: adding an empty sequence changes no attention count
    fc2 = flops.gem_flops(m, src.spec, L([0, 3, 0]))
    assert fc2.attention_total == fc.attention_total


def test_block_layers_count_blocks():
    cfg, src = _tiny(["model.attention=[block:2]", "model.causal=false"])
    fc = flops.gem_flops(cfg.model, src.spec, L([5]))
    per_pair = 4 * cfg.model.num_heads * cfg.model.head_dim
    assert fc.forward["tower.attention"] == per_pair * cfg.model.num_layers * (4 + 4 + 1)


@pytest.mark.parametrize("overrides", [
    [], ["model.attention=[full,block:8]", "model.pma_queries=3"], ["model.moe.n_experts=4", "model.moe.top_k=2"],
])
def test_every_gemm_matches_torch_flop_counter(overrides):
    """Run the real model under FlopCounterMode: its mm/addmm FLOPs (all the Linear layers) must
    equal our analytic GEMM count, so the counter cannot drift from the model's structure."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg, src = _tiny(overrides)
    model = build_model(cfg.model, src.spec)
    batch = src.train_batch(0)
    with FlopCounterMode(display=False) as counter:
        model(batch)
    counts = counter.get_flop_counts()["Global"]
    torch_gemm = sum(v for op, v in counts.items() if str(op) in ("aten.mm", "aten.addmm"))
    assert torch_gemm > 0, counts
    fc = flops.gem_flops(cfg.model, src.spec, batch.seq_lengths_cpu())
    ours = sum(v for k, v in fc.forward.items() if not k.endswith(".attention"))
    assert torch_gemm == ours


def test_peak_table_and_mfu():
    assert lookup_peak("NVIDIA H200") == 989.0
    assert lookup_peak("NVIDIA H100 PCIe") == 756.0
    assert lookup_peak("NVIDIA H100 80GB HBM3") == 989.0
    assert lookup_peak("NVIDIA B200") == 2250.0
    assert lookup_peak("Some Future GPU") is None
    peak = Peak(1000.0, "test")
    assert mfu(500e12, 1.0, peak) == pytest.approx(0.5)
    # one rank: E2E MFU equals Local MFU (scaling ratio 1)
    assert e2e_mfu(500e12, 1, 1.0, peak) == pytest.approx(mfu(500e12, 1.0, peak))


def test_peak_and_mfu_cells_read_on_a_cpu():
    """A measured CPU peak keeps its digits (0.0512, not 0.1 or 0.0), and an MFU above 100% (a
    measured peak on a busy machine) says what to do."""
    from gemctl.cli import _mfu_cell
    from gemctl.metrics.mfu import Peak

    assert Peak(0.05123, "measured").describe() == "0.0512 TFLOP/s (measured)"
    assert Peak(989.0, "datasheet H100").describe() == "989.0 TFLOP/s (datasheet H100)"
    assert Peak(5.0, "measured").describe() == "5.00 TFLOP/s (measured)"
    assert _mfu_cell(0.4567) == "45.67%"
    assert _mfu_cell(1.2252).startswith("122.52% (above 100%") and "metrics.peak_tflops" in _mfu_cell(1.2252)


def test_trainer_counts_with_the_one_definition():
    """The trainer reads its per-step config from plain dataclasses (host time); its FLOP count is
    gem_flops of the composed config all the same, and a plain (unstructured) node is kept as is."""
    from omegaconf import OmegaConf

    from gemctl.config.schema import ModelConfig, TrainConfig
    from gemctl.train.trainer import Trainer, _plain

    cfg, src = _tiny(["model.attention=[full,block:8]"])
    trainer = Trainer(cfg, source=src)
    assert isinstance(trainer._model_cfg, ModelConfig) and isinstance(trainer._train_cfg, TrainConfig)
    batch = src.train_batch(1)
    assert trainer.batch_flops(batch).forward == flops.gem_flops(cfg.model, src.spec, batch.seq_lengths_cpu()).forward
    node = OmegaConf.create({"grad_clip": 1.0})
    assert _plain(node) is node
