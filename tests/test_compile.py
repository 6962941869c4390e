"""parallel.compile: the sequence tower's layers under torch.compile (gemctl.parallel.compile)."""

from __future__ import annotations

import pytest
import torch

from gemctl.config.compose import compose
from gemctl.config.validate import validate
from gemctl.errors import ConfigError
from gemctl.parallel import compile as compile_mod
from gemctl.train import trainer as trainer_mod
from gemctl.model.sequence import layer_kinds
from gemctl.train.trainer import train

SHORT = ["train.steps=6", "train.log_every=3", "train.warmup_timing_steps=1", "train.eval_batches=1", "run.progress=false"]


def _run(tmp_path, overrides):
    cfg = compose(SHORT + list(overrides))
    validate(cfg)
    return train(cfg, run_root=str(tmp_path))


@pytest.fixture
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_layers_train_as_eager_cpu(tmp_path, monkeypatch, _fresh_dynamo):
    """Same seed, same losses and NE with the tower's layers compiled (aot_eager: the traced graphs
    run the same ATen ops, so any difference would be the wrapping's); the compile is timed and every
    layer went through the compiler."""
    monkeypatch.setattr(compile_mod, "BACKEND", "aot_eager")
    traced = []
    real = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: traced.append(type(self).__name__) or real(self, **kw))
    before = compile_mod.compile_seconds()
    eager = _run(tmp_path / "eager", [])
    assert not traced and compile_mod.compile_seconds() == before
    compiled = _run(tmp_path / "compiled", ["parallel.compile=true"])
    assert traced == ["SequenceLayer"] * len(layer_kinds(compose(SHORT).model))
    assert compile_mod.compile_seconds() > before
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-5, abs=1e-6)
    tasks = [t for t, m in eager.eval.items() if isinstance(m, dict) and "ne" in m]
    assert tasks
    for task in tasks:
        assert compiled.eval[task]["ne"] == pytest.approx(eager.eval[task]["ne"], rel=1e-5)


def test_compile_time_counts_as_setup_time(monkeypatch):
    """The trainer leaves torch.compile's seconds out of the step times, as it does Triton's."""
    monkeypatch.setattr(compile_mod, "_seconds", 2.5)
    base = trainer_mod.kernel_setup_seconds()
    monkeypatch.setattr(compile_mod, "_seconds", 4.0)
    assert trainer_mod.kernel_setup_seconds() - base == pytest.approx(1.5)


def test_compile_timer_subtracts_triton_work_inside_it(monkeypatch):
    """A Triton autotune or compile during a torch.compile is counted once (as Triton's), not twice."""
    clock = {"t": 10.0, "triton": 1.0}
    monkeypatch.setattr(compile_mod.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(compile_mod, "_triton_seconds", lambda: clock["triton"])
    monkeypatch.setattr(compile_mod, "_seconds", 0.0)
    compile_mod._on_start(None)
    clock["t"], clock["triton"] = 13.0, 1.5  # 3 s of wall time, 0.5 s of it Triton's
    compile_mod._on_end(None)
    assert compile_mod.compile_seconds() == pytest.approx(2.5)
    compile_mod._on_end(None)  # an end without a start adds nothing
    assert compile_mod.compile_seconds() == pytest.approx(2.5)


def test_parallel_compile_must_be_a_bool():
    with pytest.raises(ConfigError, match="parallel.compile"):
        validate(compose(["parallel.compile=sometimes"]))


@pytest.mark.gpu
def test_compiled_layers_train_as_eager_gpu(tmp_path, _fresh_dynamo):
    """On CUDA with Inductor (its own fused kernels around our Triton ops): a deterministic run's
    losses stay within bf16 rounding of the eager run's."""
    args = ["train.device=cuda", "train.deterministic=true", "model=small"]
    eager = _run(tmp_path / "eager", args)
    compiled = _run(tmp_path / "compiled", args + ["parallel.compile=true"])
    assert compiled.losses == pytest.approx(eager.losses, rel=2e-2)
    assert all(torch.isfinite(torch.tensor(compiled.losses)))
