"""Nothing a user loads can run code: YAML cannot instantiate classes (no open ``_target_``; the
typed schema refuses unknown keys and gemctl never calls Hydra's instantiate), checkpoint files
are read weights-only and DCP's pickled metadata through an allowlist. (Shell metacharacters in
SLURM fields: tests/test_parallel.py::test_slurm_refuses_shell_metacharacters.)"""

from __future__ import annotations

import ast
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import gemctl

ROOT = Path(__file__).resolve().parents[1]


class _Touch:
    """A pickle payload that creates a file when unpickled."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def _gemctl(*args, cwd):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "gemctl", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)


@pytest.mark.parametrize("where", ["root", "group", "command line"])
def test_yaml_target_is_refused_and_never_called(tmp_path, where):
    marker = tmp_path / "pwned"
    payload = f"_target_: pathlib.Path.touch\n_args_: ['{marker}']\n"
    args = [f"run.output_dir={tmp_path / 'runs'}", "train.steps=1"]
    if where == "command line":
        args += ["+model._target_=pathlib.Path.touch", f"+model._args_=['{marker}']"]
        key = "model._target_"
    else:
        body = payload if where == "root" else "model:\n" + "".join("  " + ln + "\n" for ln in payload.splitlines())
        (tmp_path / "evil.yaml").write_text("# @package _global_\n" + body)
        args = ["--recipe", str(tmp_path / "evil.yaml")] + args
        key = "_target_" if where == "root" else "model._target_"
    proc = _gemctl("train", *args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith(f"gemctl: error: {key}: unknown key"), proc.stderr
    assert not marker.exists() and not (tmp_path / "runs").exists()


def test_gemctl_never_instantiates_from_config():
    """No call of hydra.utils.instantiate / call (the only way a `_target_` could run)."""
    for path in Path(gemctl.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, (ast.Name, ast.alias)):
                name = getattr(node, "id", None) or getattr(node, "name", None)
            assert name not in ("instantiate", "hydra.utils.instantiate", "get_method", "get_class"), path


def _checkpointed_run(tmp_path):
    from gemctl.config.compose import compose
    from gemctl.config.validate import validate
    from gemctl.train.trainer import Trainer, prepare_process

    def train(name, overrides):
        cfg = compose(["train.steps=4", "train.warmup_timing_steps=1", "train.log_every=2", "run.progress=false",
                       "data.synthetic.eval_samples=64", "data.eval_batch_size=64", "data.batch_size=16",
                       f"run.name={name}", *overrides])
        validate(cfg)
        prepare_process()
        return Trainer(cfg, run_root=str(tmp_path)).fit()

    ckpts = tmp_path / "ckpt"
    full = train("full", ["train.checkpoint_every=2", f"train.checkpoint_dir={ckpts}", "train.keep_last=0"])
    return train, ckpts, full


@pytest.mark.parametrize("target", ["rank0.pt", ".metadata"])
def test_pickled_code_in_a_checkpoint_never_runs(tmp_path, target):
    """A crafted pickle in the newest checkpoint (the rank's RNG file, or DCP's metadata): it is
    refused as unreadable, the previous checkpoint is used, and the payload never runs."""
    train, ckpts, full = _checkpointed_run(tmp_path)
    marker = tmp_path / "pwned"
    (ckpts / "step-00000004" / target).write_bytes(pickle.dumps(_Touch(marker)))
    resumed = train("resumed", [f"train.resume={ckpts}"])
    assert not marker.exists()
    assert resumed.losses == full.losses[2:]  # from step 2: the crafted checkpoint was skipped
