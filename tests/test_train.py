"""End-to-end training on CPU: golden loss curve, run-directory outputs, learning on real data."""

import json
import math
import os
from pathlib import Path

import pytest
import torch

from gemctl.config.compose import compose
from gemctl.config.validate import validate
from gemctl.train.trainer import train

GOLDEN = Path(__file__).parent / "assets" / "golden_cpu_smoke.json"


def _run(tmp_path, overrides=(), recipe=None):
    cfg = compose(list(overrides) + ["run.progress=false"], recipe=recipe)
    validate(cfg)
    return train(cfg, run_root=str(tmp_path))


def test_golden_loss_curve(tmp_path):
    """The seeded cpu_smoke recipe reproduces the stored per-step losses.

    Regenerate after an intended change with: GEMCTL_UPDATE_GOLDEN=1 pytest tests/test_train.py -k golden
    (and compare old and new curves with scripts/loss_compare.py).
    """
    result = _run(tmp_path, recipe="cpu_smoke")
    assert len(result.losses) == 40
    if os.environ.get("GEMCTL_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({"recipe": "cpu_smoke", "torch": torch.__version__, "losses": result.losses}, indent=1))
    golden = json.loads(GOLDEN.read_text())
    assert result.losses == pytest.approx(golden["losses"], rel=1e-4, abs=1e-5)


def test_same_seed_same_run(tmp_path):
    a = _run(tmp_path / "a", ["train.steps=6", "train.log_every=3", "train.warmup_timing_steps=1", "train.eval_batches=1"])
    b = _run(tmp_path / "b", ["train.steps=6", "train.log_every=3", "train.warmup_timing_steps=1", "train.eval_batches=1"])
    assert a.losses == b.losses
    c = _run(tmp_path / "c", ["train.steps=6", "train.log_every=3", "train.warmup_timing_steps=1", "train.eval_batches=1", "train.seed=1"])
    assert a.losses != c.losses


@pytest.fixture
def _restore_determinism():
    from gemctl.ops.triton import common

    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    common.set_autotune(None)
    if workspace is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace


@pytest.mark.parametrize("setting, device, expect", [
    (None, "cpu", (True, False)), (None, "cuda", (False, False)), (True, "cuda", (True, True)), (False, "cpu", (False, False)),
])
def test_deterministic_setting(_restore_determinism, monkeypatch, setting, device, expect):
    """train.deterministic: null = CPU only (the default), true = every device (warn-only on CUDA,
    where some ops have no deterministic kernel), false = off."""
    from gemctl.train.trainer import seed_everything

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.use_deterministic_algorithms(False)
    seed_everything(0, setting, torch.device(device))
    got = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    assert got == expect
    assert ("CUBLAS_WORKSPACE_CONFIG" in os.environ) == (device == "cuda" and setting is True)
    from gemctl.ops.triton import common

    monkeypatch.setenv("GEMCTL_AUTOTUNE", "1")
    assert common.autotune_enabled() == (not (device == "cuda" and setting is True))  # fixed kernel configs


@pytest.mark.gpu
def test_deterministic_gpu_runs_repeat_with_autotune_on(tmp_path, _restore_determinism, monkeypatch):
    """The CLI autotunes (the test suite does not, conftest): train.deterministic=true must still
    repeat, so it has to pin the Triton configs itself."""
    monkeypatch.setenv("GEMCTL_AUTOTUNE", "1")
    args = ["train.device=cuda", "train.deterministic=true", "train.steps=20", "train.log_every=5",
            "train.warmup_timing_steps=1", "train.eval_batches=2", "model=small"]
    a = _run(tmp_path / "a", args)
    b = _run(tmp_path / "b", args)
    assert a.losses == b.losses and a.eval == b.eval


@pytest.mark.gpu
def test_deterministic_gpu_runs_repeat(tmp_path, _restore_determinism):
    """With train.deterministic=true two CUDA runs of one seed give the same losses and NE (the
    precision ablation relies on it to compare recipes seed by seed)."""
    args = ["train.device=cuda", "train.deterministic=true", "train.steps=20", "train.log_every=5",
            "train.warmup_timing_steps=1", "train.eval_batches=2"]
    a = _run(tmp_path / "a", args)
    b = _run(tmp_path / "b", args)
    assert a.losses == b.losses
    assert a.eval == b.eval


def test_gradient_norms_are_recorded_before_clipping(tmp_path):
    """Each step's dense gradient norm before clipping is in the result, summary.json and the
    metrics records, with how many steps the clip scaled down: the same first-step norm whatever
    the clip (it is read before clipping), every step clipped under a tiny clip, none under a huge
    one, and no norms when clipping is off (a skipped step has none either: test_faults)."""
    common = ["train.steps=6", "train.log_every=3", "train.warmup_timing_steps=1", "train.eval_batches=1"]
    tiny = _run(tmp_path / "tiny", common + ["train.grad_clip=1e-6"])
    huge = _run(tmp_path / "huge", common + ["train.grad_clip=1e9"])
    off = _run(tmp_path / "off", common + ["train.grad_clip=0"])
    assert len(tiny.grad_norms) == len(huge.grad_norms) == 6
    assert all(math.isfinite(x) and x > 1e-6 for x in tiny.grad_norms + huge.grad_norms)
    assert tiny.grad_norms[0] == huge.grad_norms[0]
    assert tiny.grad_norms[1:] != huge.grad_norms[1:]  # the clipped updates took another path
    assert off.grad_norms == [None] * 6
    for result, clipped in ((tiny, 6), (huge, 0)):
        summary = json.loads((result.run_dir / "summary.json").read_text())
        assert summary["grad_norms"] == result.grad_norms
        assert summary["grad_norm"]["clipped_steps"] == clipped and summary["grad_norm"]["nonfinite_norm_steps"] == 0
        assert summary["grad_norm"]["grad_norm_max"] == max(result.grad_norms)
        records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        train_recs = [r for r in records if r["kind"] == "train"]
        assert sum(r["clipped_steps"] for r in train_recs) == clipped
        assert max(r["grad_norm_max"] for r in train_recs) == max(result.grad_norms)
    summary = json.loads((off.run_dir / "summary.json").read_text())
    assert summary["grad_norm"] == {} and summary["grad_norms"] == [None] * 6  # JSON null, not NaN


def test_run_directory_contents(tmp_path):
    result = _run(tmp_path, ["train.steps=12", "train.log_every=4", "train.warmup_timing_steps=4", "train.eval_batches=1"])
    run = result.run_dir
    assert (run / "config.yaml").is_file()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds.count("train") == 3 and kinds[-2:] == ["eval", "summary"]
    for r in records[:3]:
        for key in ("loss", "qps", "model_tflops", "local_mfu", "data_wait_ms_per_step", "step_time_ms"):
            assert math.isfinite(r[key]) and r[key] >= 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["perf"]["timed_steps"] == 8  # the first 4 steps are left out of throughput
    assert "measured" in summary["perf"]["peak"]  # a CPU has no datasheet peak: labelled measured
    assert 0 < summary["eval"]["ctr"]["auc"] <= 1
    assert 0 < summary["perf"]["peak_host_memory_gib"] < 64  # the CPU run's peak RSS
    png = (run / "curves.png").read_bytes()  # loss, MFU and eval NE curves
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_curves_plot_the_runs_records(tmp_path, monkeypatch):
    """plot_curves draws what it is given: every finite step loss (from first_step), the windows'
    MFU, and an NE panel only when the run evaluated; a failing plot is said, not raised."""
    from gemctl.train import curves

    drawn = {}

    class Axes:
        def __init__(self, i):
            self.i = i

        def plot(self, x, y, *a, **k):
            drawn.setdefault(self.i, []).append((list(x), list(y)))

        def __getattr__(self, name):
            return lambda *a, **k: None

    class Plt:
        def subplots(self, rows, cols, **k):
            drawn["panels"] = cols
            return self, [Axes(i) for i in range(cols)]

        def __getattr__(self, name):
            return lambda *a, **k: None

    monkeypatch.setattr("gemctl.profile.plots.pyplot", lambda: Plt())
    records = [{"kind": "train", "step": 4, "loss": 1.0, "local_mfu": 0.1},
               {"kind": "train", "step": 8, "loss": 0.9, "local_mfu": None, "e2e_mfu": 0.2}]
    curves.plot_curves([1.2, float("nan"), None, 0.8], records, tmp_path / "c.png", "t", first_step=5)
    assert drawn["panels"] == 2
    assert drawn[0][0] == ([5, 8], [1.2, 0.8])  # the non-finite and missing losses left out
    assert drawn[1][0] == ([4, 8], [10.0, 20.0])  # MFU in %, E2E where Local is absent
    records.append({"kind": "eval", "step": 8, "ctr": {"ne": 0.9}, "samples": 10})
    curves.plot_curves([1.0], records, tmp_path / "c.png", "t")
    assert drawn["panels"] == 3 and drawn[2][0] == ([8], [0.9])


def test_a_plot_that_fails_is_said_and_the_run_stands(tmp_path):
    from rich.console import Console

    from gemctl.config.compose import compose
    from gemctl.train.trainer import Trainer

    console = Console(record=True, width=200)
    trainer = Trainer(compose(["train.steps=2"]), console=console)
    trainer._plot_curves(tmp_path, [1.0], 1)  # no metrics.jsonl there
    assert "curves.png not written: FileNotFoundError" in console.export_text()
    assert not (tmp_path / "curves.png").exists()


def test_kernel_tuning_and_compiles_are_taken_out_of_step_times(tmp_path, monkeypatch):
    """A Triton kernel tuning a new shape in a timed step (here: 1 s faked inside step 6) is not
    step time: its window's step time leaves it out, reports it, and the summary sums it."""
    import time

    from gemctl.train import trainer as trainer_mod

    tuned = {"s": 0.0, "steps": 0}
    real_step = trainer_mod.Trainer.train_step

    def step(self, batch):
        tuned["steps"] += 1
        if tuned["steps"] == 6:  # the main run's sixth step (no scaling baseline on one CPU rank)
            time.sleep(1.0)
            tuned["s"] += 1.0
        return real_step(self, batch)

    monkeypatch.setattr(trainer_mod.Trainer, "train_step", step)
    monkeypatch.setattr(trainer_mod, "kernel_setup_seconds", lambda: tuned["s"])
    result = _run(tmp_path, ["train.steps=12", "train.log_every=4", "train.warmup_timing_steps=4", "train.eval_batches=1"])
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    train_recs = [r for r in records if r["kind"] == "train"]
    assert [r["setup_s"] for r in train_recs] == [0.0, 1.0, 0.0]
    assert train_recs[1]["step_time_ms"] < 250  # the 1 s left out (it would add 250 ms a step)
    assert result.perf["setup_s_in_timed_steps"] == 1.0
    assert result.perf["step_time_ms"] < 250


def test_learns_the_synthetic_teacher(tmp_path):
    result = _run(tmp_path, ["train.steps=120", "train.eval_batches=4"])
    assert result.eval["ctr"]["ne"] < 0.95
    assert result.eval["ctr"]["auc"] > 0.7


@pytest.mark.slow
def test_movielens_beats_item_popularity(tmp_path):
    pytest.importorskip("importlib.util")
    from gemctl.data.movielens import movielens100k_dir

    try:
        movielens100k_dir()
    except Exception:
        pytest.skip("MovieLens-100K (recbole wheel) not installed")
    result = _run(tmp_path, ["data=movielens100k", "train.steps=200"])
    base = result.baselines["item_popularity"]
    assert result.eval["ctr"]["auc"] > base["auc"]
    assert result.eval["ctr"]["ne"] < base["ne"]
