"""Non-finite loss or gradients: train.nonfinite=stop ends the run with one line naming the step,
the tensor and the batch's sample ids (exit 3); skip drops the step's update, warns and counts."""

import math

import pytest
import torch

from gemctl.config.compose import compose
from gemctl.config.validate import validate
from gemctl.errors import NumericalFault
from gemctl.train import trainer as trainer_mod

RUN = ["train.steps=6", "train.warmup_timing_steps=1", "train.log_every=2", "run.progress=false",
       "data.synthetic.eval_samples=64", "data.eval_batch_size=64", "data.batch_size=16"]


def _nan_at(monkeypatch, call: int):
    """compute_loss returns NaN on its ``call``-th training call (1-based)."""
    real, calls = trainer_mod.compute_loss, {"n": 0}

    def loss(logits, labels):
        out = real(logits, labels)
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] == call:
                return out * float("nan")
        return out

    monkeypatch.setattr(trainer_mod, "compute_loss", loss)


def test_stop_names_step_tensor_and_samples(tmp_path, monkeypatch):
    _nan_at(monkeypatch, 3)
    cfg = compose(RUN)
    validate(cfg)
    with pytest.raises(NumericalFault) as info:
        trainer_mod.train(cfg, run_root=str(tmp_path))
    msg = str(info.value)
    assert info.value.exit_code == 3 and "\n" not in msg
    assert msg.startswith("non-finite training loss at step 3 (nan); tensor: loss; batch sample ids [")
    # the ids are those of step 3's batch (local batch 16 -> samples 32..)
    assert "[32, 33, 34, 35, 36, 37, 38, 39]" in msg


def test_skip_drops_the_update_and_counts(tmp_path, monkeypatch):
    _nan_at(monkeypatch, 3)
    cfg = compose(RUN + ["train.nonfinite=skip"])
    validate(cfg)
    result = trainer_mod.train(cfg, run_root=str(tmp_path))
    assert [s["step"] for s in result.perf["skipped_steps"]] == [3]
    assert result.perf["skipped_steps"][0]["tensor"] == "loss"
    assert math.isnan(result.losses[2]) and all(math.isfinite(x) for i, x in enumerate(result.losses) if i != 2)


def test_skip_names_a_non_finite_gradient(tmp_path, monkeypatch):
    from gemctl.train.trainer import Trainer, prepare_process

    cfg = compose(RUN + ["train.nonfinite=skip"])
    validate(cfg)
    prepare_process()
    tr = Trainer(cfg, run_root=str(tmp_path))
    weight = tr.model.heads.parameters().__next__()
    state = {"n": 0}

    def poison(grad):
        state["n"] += 1
        return grad * float("nan") if state["n"] == 2 else grad

    weight.register_hook(poison)
    result = tr.fit()
    (skipped,) = result.perf["skipped_steps"]
    assert skipped["step"] == 2 and skipped["tensor"].startswith("gradient of heads.")
