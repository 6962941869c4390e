"""Checkpoints: exact resume (losses and final parameters of a run resumed from step k equal the
uninterrupted run's), unpublished (torn) checkpoints never loaded, keep-last-N, clear errors."""

import os

import pytest
import torch

from gemctl.config.compose import compose
from gemctl.config.validate import validate
from gemctl.errors import UserError

RUN = ["train.steps=8", "train.warmup_timing_steps=1", "train.log_every=2", "run.progress=false",
       "data.synthetic.eval_samples=64", "data.eval_batch_size=64", "data.batch_size=16", "shuffle=bbs",
       "shuffle.sub_batch_size=8"]


def _train(tmp_path, name, overrides, console=None):
    from gemctl.train.trainer import Trainer, prepare_process

    cfg = compose(RUN + [f"run.name={name}"] + overrides)
    validate(cfg)
    prepare_process()
    trainer = Trainer(cfg, run_root=str(tmp_path), console=console)
    result = trainer.fit()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return result, params


def test_exact_resume(tmp_path, recwarn):
    ckpts = tmp_path / "ckpt"
    full, full_params = _train(tmp_path, "full", ["train.checkpoint_every=4", f"train.checkpoint_dir={ckpts}",
                                                  "train.keep_last=0"])
    assert sorted(os.listdir(ckpts)) == ["step-00000004", "step-00000008"]
    resumed, resumed_params = _train(tmp_path, "resumed", [f"train.resume={ckpts / 'step-00000004'}"])
    assert resumed.losses == full.losses[4:]  # exactly: same batches, states and RNG
    for name, value in full_params.items():
        assert torch.equal(resumed_params[name], value), name
    assert resumed.eval == full.eval
    # resumed at the last step: nothing to train, and it says so
    import io

    from rich.console import Console

    out = io.StringIO()
    done, _ = _train(tmp_path, "done", [f"train.resume={ckpts}"], console=Console(file=out, width=200))
    assert done.losses == []
    assert "the checkpoint is at step 8, train.steps=8: no step left to train" in out.getvalue()
    # one process: DCP's "assuming the intent is to save/load in a single process" is not repeated to the user
    assert not [w for w in recwarn if "torch.distributed is" in str(w.message)]


def test_torn_checkpoint_is_never_loaded_and_keep_last(tmp_path):
    from gemctl.train import checkpoint

    ckpts = tmp_path / "ckpt"
    _train(tmp_path, "a", ["train.checkpoint_every=2", f"train.checkpoint_dir={ckpts}", "train.keep_last=2"])
    assert sorted(os.listdir(ckpts)) == ["step-00000006", "step-00000008"]  # older ones pruned
    (ckpts / ".tmp-step-00000010").mkdir()  # a save interrupted mid-write
    (ckpts / "step-00000012").mkdir()  # a directory without meta.json is not a checkpoint either
    assert checkpoint.find("auto", ckpts) == ckpts / "step-00000008"
    assert checkpoint.find(str(ckpts), ckpts) == ckpts / "step-00000008"


def test_resume_errors(tmp_path):
    from gemctl.train import checkpoint

    assert checkpoint.find("auto", tmp_path / "nothing") is None  # auto with nothing: a fresh start
    with pytest.raises(UserError, match="train.resume: no published checkpoint"):
        checkpoint.find(str(tmp_path / "nothing"), tmp_path)
    with pytest.raises(UserError, match="train.resume: no published checkpoint"):  # nothing half-written
        _train(tmp_path / "runs", "resume", [f"train.resume={tmp_path / 'nothing'}"])
    assert list((tmp_path / "runs" / "resume").iterdir()) == []


def test_corrupt_newest_falls_back_to_the_previous(tmp_path):
    ckpts = tmp_path / "ckpt"
    full, _ = _train(tmp_path, "full", ["train.checkpoint_every=2", f"train.checkpoint_dir={ckpts}", "train.keep_last=0"])
    data = ckpts / "step-00000008" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])  # the newest, truncated
    resumed, _ = _train(tmp_path, "resumed", [f"train.resume={ckpts}"])
    assert resumed.losses == full.losses[6:8]  # from step 6, the newest readable one
    with pytest.raises(UserError, match="is unreadable"):  # asked for that step: no fallback
        _train(tmp_path, "again", [f"train.resume={ckpts / 'step-00000008'}"])


def test_mismatched_checkpoint_names_the_tensor(tmp_path):
    ckpts = tmp_path / "ckpt"
    _train(tmp_path, "a", ["train.checkpoint_every=4", f"train.checkpoint_dir={ckpts}"])
    with pytest.raises(UserError, match=r"tensor sparse\.seq\.embeddings\.seq_item_id\.weight is \[20000, 32\] in .* "
                                        r"but \[30000, 32\] in this model"):
        _train(tmp_path, "b", [f"train.resume={ckpts}", "data.synthetic.num_items=30000"])


def test_async_checkpoints_resume_exactly(tmp_path):
    """train.async_checkpoint: the state is copied at the step and written in the background; every
    checkpoint is published (the last one at the end of training) and resumes exactly."""
    ckpts = tmp_path / "ckpt"
    full, full_params = _train(tmp_path, "full", ["train.checkpoint_every=2", f"train.checkpoint_dir={ckpts}",
                                                  "train.keep_last=0", "train.async_checkpoint=true"])
    assert sorted(os.listdir(ckpts)) == [f"step-0000000{s}" for s in (2, 4, 6, 8)]
    assert full.perf["checkpoint_blocking_s"] > 0
    resumed, resumed_params = _train(tmp_path, "resumed", [f"train.resume={ckpts / 'step-00000004'}"])
    assert resumed.losses == full.losses[4:]
    for name, value in full_params.items():
        assert torch.equal(resumed_params[name], value), name
