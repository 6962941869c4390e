"""Non-finite loss or gradients: train.nonfinite=stop ends the run with one line naming the step,
the tensor and the batch's sample ids (exit 3); skip drops the step's update, warns and counts."""

import json
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

    def loss(logits, labels, weights=None):
        out = real(logits, labels, weights)
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
    # the skipped step has no gradient norm; the others keep theirs, aligned with their losses
    assert result.grad_norms[2] is None and all(x is not None and math.isfinite(x) for i, x in enumerate(result.grad_norms) if i != 2)
    # summary.json stays strict JSON: the skipped step's loss and norm are null
    text = (result.run_dir / "summary.json").read_text()
    summary = json.loads(text, parse_constant=lambda c: pytest.fail(f"summary.json holds {c}"))
    assert summary["losses"][2] is None and summary["grad_norms"][2] is None
    assert summary["losses"][:2] == result.losses[:2]


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


# ------------------------------------------------------------------------------------------------
# Rank failures: the sample ledger and a SIGKILLed rank under torchrun with max_restarts.

def _ledger_file(run_dir, rank, records):
    import json

    path = run_dir / "samples"
    path.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": s, "attempt": a, "pid": 1, "ids": ids}) for s, a, ids in records]
    (path / f"rank{rank}.jsonl").write_text("\n".join(lines) + "\n")


def test_ledger_keeps_the_latest_attempt_and_counts_lost_and_duplicated(tmp_path):
    from gemctl.train import ledger

    ref, run = tmp_path / "ref", tmp_path / "run"
    _ledger_file(ref, 0, [(1, 0, [1, 2]), (2, 0, [3, 4]), (3, 0, [5, 6])])
    # attempt 0 trained steps 1-3 and was killed; attempt 1 resumed from the step-1 checkpoint
    _ledger_file(run, 0, [(1, 0, [1, 2]), (2, 0, [9, 9]), (3, 0, [9, 9]), (2, 1, [3, 4]), (3, 1, [5, 6])])
    (run / "samples" / "rank0.jsonl").open("a").write('{"step": 4, "att')  # torn by the kill
    assert ledger.history(run) == {(0, 1): [1, 2], (0, 2): [3, 4], (0, 3): [5, 6]}
    acc = ledger.account(run, ref)
    assert (acc["lost"], acc["duplicated"], acc["mismatched_steps"], acc["attempts"]) == (0, 0, [], 2)
    # a resume that skipped step 2 and trained step 3 on step 1's samples: 2 lost, 2 duplicated
    _ledger_file(run, 0, [(1, 0, [1, 2]), (3, 1, [1, 2])])
    acc = ledger.account(run, ref)
    assert (acc["lost"], acc["duplicated"]) == (4, 2) and acc["mismatched_steps"] == [(0, 2), (0, 3)]


@pytest.mark.slow
def test_killed_rank_restarts_from_the_last_checkpoint_exactly(tmp_path):
    """torchrun, 2 gloo ranks, launcher.max_restarts=1: a rank SIGKILLed at a random step (maybe
    mid-checkpoint) -> the workers restart, resume from the newest complete checkpoint, and the
    run ends with the uninterrupted run's samples, losses, eval and final model + optimizer."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("fault_inject", Path(__file__).parents[1] / "scripts" / "fault_inject.py")
    fault_inject = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fault_inject)
    report = fault_inject.run(tmp_path, kills=1, nproc=2, steps=8, every=2, seed=1, say=lambda *_: None)
    assert report["restarts"] == 1
    assert report["samples_trained"] == 8 * 16
    assert (report["samples_lost"], report["samples_duplicated"], report["steps_with_other_samples"]) == (0, 0, 0)
    assert report["losses_equal"] and report["eval_equal"] and report["final_state_equal"], report
    assert report["ok"]
