"""`gemctl profile` on CPU: categories add up, the MFU identity holds, the outputs exist."""

import json
from pathlib import Path

import pytest

from gemctl.config.compose import compose
from gemctl.config.validate import validate
from gemctl.profile.runner import profile
from gemctl.train.trainer import Trainer, prepare_process


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    cfg = compose(["profile.steps=4", "profile.warmup_steps=2", "run.progress=false"])
    validate(cfg)
    prepare_process()
    return profile(Trainer(cfg), out_root=str(tmp_path_factory.mktemp("profile")))


def test_categories_add_up_to_the_step(report):
    # busy time per category + idle (host overhead, data wait) = the profiled step time
    accounted, step = report["accounted_s"], report["profiled_step_time_s"]
    assert abs(accounted - step) / step < 0.05, (accounted, step)
    # categories never double count: their sum fits in the profiler's window
    assert sum(report["categories_s"].values()) <= report["profiler_window_s"] * 1.001


def test_every_category_of_the_model_shows_up(report):
    cats = report["categories_s"]
    for name in ("gemm", "attention", "embedding", "norm/elementwise", "optimizer"):
        assert cats[name] > 0, name
    assert cats["communication"] == 0  # one process
    assert set(report["modules_s"]) >= {"sparse", "cross", "pma", "tower.layers.0", "tower.layers.1", "heads"}


def test_top_kernels_rank_the_step(report):
    """The top table: operators by self time on a CPU (kernels on a GPU), most first, never more
    than the busy time, and the model's products among them."""
    top = report["top_kernels"]
    assert 0 < len(top) <= 15
    ms = [k["ms_per_step"] for k in top]
    assert ms == sorted(ms, reverse=True) and all(k["calls_per_step"] > 0 for k in top)
    assert sum(ms) / 1e3 <= sum(report["categories_s"].values()) * 1.001
    assert not any(k["name"].startswith(("gemctl.", "ProfilerStep")) for k in top)
    assert any(k["name"] in ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear") for k in top)


def test_top_kernels_on_a_gpu_read_the_device_events():
    """On a GPU the table reads the device's own events (kernels linked to no operator count too),
    summed by name over the profiled steps; the ranges on the device timeline are left out."""
    from types import SimpleNamespace as NS

    from gemctl.profile.breakdown import top_kernels

    def gpu(name, us):
        return NS(name=name, device_type="DeviceType.CUDA", device_time_total=us, self_cpu_time_total=0)

    events = [gpu("_fp8_gemm_tma_kernel", 300), gpu("_fp8_gemm_tma_kernel", 320), gpu("_cast_rows_kernel", 80),
              gpu("gemctl.gemm.fp8_gemm", 700), gpu("ProfilerStep#3", 5000),
              NS(name="aten::add", device_type="DeviceType.CPU", device_time_total=0, self_cpu_time_total=50)]
    top = top_kernels(events, steps=2, device="cuda")
    assert [k["name"] for k in top] == ["_fp8_gemm_tma_kernel", "_cast_rows_kernel"]
    assert top[0]["calls_per_step"] == 1 and top[0]["ms_per_step"] == pytest.approx(0.31)
    assert top[0]["share"] == pytest.approx(620 / 700)


def test_mfu_identity(report):
    assert report["e2e_mfu"] == pytest.approx(report["local_mfu"] * report["scaling_ratio"], rel=1e-9)
    assert 0 < report["scaling_ratio"] <= 1
    stages = dict(report["waterfall"])
    assert stages["peak"] == 1.0
    # the waterfall closes: peak minus every loss = E2E MFU of the profiled steps
    losses = sum(v for k, v in report["waterfall"] if k not in ("peak", "E2E MFU"))
    assert 1.0 + losses == pytest.approx(stages["E2E MFU"], abs=1e-9)


def test_outputs_written(report):
    run = Path(report["run_dir"])
    for name in ("profile.json", "trace.json", "breakdown.png", "waterfall.png"):
        assert (run / name).stat().st_size > 0, name
    written = json.loads((run / "profile.json").read_text())
    assert written["steps"] == 4
    from gemctl.metrics.provenance import source_commit

    assert written["provenance"]["commit"] == source_commit()  # what the profile belongs to


def test_collective_launches_count_as_communication():
    """NCCL kernels belong to the record_param_comms range around their launch (their innermost
    CPU op), gloo's to c10d's ops; matrix products and the rest keep their categories."""
    from gemctl.profile.breakdown import _by_name

    for name in ("record_param_comms", "nccl:all_gather_into_tensor_coalesced", "c10d::_allgather_base_",
                 "gloo:all_reduce"):
        assert _by_name(name) == "communication", name
    assert _by_name("aten::mm") == "gemm" and _by_name("aten::add_") is None


def test_fp8_gemm_kernels_count_as_gemm():
    """A Triton GEMM kernel is linked to the operator around its launch (the FP8 linear's autograd
    node), whose category is norm/elementwise: the breakdown counts the kernels named in
    GEMM_KERNELS as gemm and leaves the node's other kernels (the casts) where they were. The
    H200 profile of fp8_tower put ~16 ms a step of FP8 GEMMs under norm/elementwise and reported
    gemm at 7,400 TF/s before."""
    from types import SimpleNamespace as NS

    from gemctl.profile.breakdown import GEMM_KERNELS, breakdown

    def event(name, thread, start, end, kernels=(), seq=-1):
        return NS(name=name, thread=thread, cpu_parent=None, sequence_nr=seq, device_type=None,
                  time_range=NS(start=start, end=end), self_cpu_time_total=end - start,
                  kernels=[NS(name=k, device=0, duration=us) for k, us in kernels],
                  self_device_time_total=sum(us for _, us in kernels))

    forward = event("gemctl.forward", 1, 0, 400)
    linear = event("gemctl::fp8_linear", 1, 10, 300, [("_cast_rows_kernel", 30), (GEMM_KERNELS[1], 120)], seq=7)
    node = event("autograd::engine::evaluate_function: Fp8LinearBackward", 2, 400, 1000,
                 [("_cast_cols_amax_kernel", 50), (GEMM_KERNELS[0], 200), (GEMM_KERNELS[1], 210)], seq=7)
    out = breakdown([forward, linear, node], steps=1, device="cuda", window_us=1000)
    assert out.category_s["gemm"] == pytest.approx((120 + 200 + 210) * 1e-6)
    assert out.category_s["norm/elementwise"] == pytest.approx((30 + 50) * 1e-6)
    assert out.idle_s == pytest.approx((1000 - 610) * 1e-6)


def test_ranges_open_only_while_profiling():
    """The per-call ranges (attention, FP8 GEMMs, embedding) cost host time: opened while a
    profiler runs, a no-op otherwise."""
    import contextlib

    import torch

    from gemctl.ops.ranges import profiled

    assert isinstance(profiled("gemctl.gemm.x"), contextlib.nullcontext)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert not isinstance(profiled("gemctl.gemm.x"), contextlib.nullcontext)


def test_kernel_setup_in_the_timed_steps_is_left_out(tmp_path, monkeypatch):
    """A compile or autotuning that lands in the profile's timed steps (a shape the warmup missed)
    is not step time: 1 s of it over 2 steps would add 500 ms to each."""
    import time

    from gemctl.profile import runner

    clock = {"s": 0.0, "calls": 0}
    real_step = Trainer.train_step

    def step(self, batch):
        clock["calls"] += 1
        if clock["calls"] == 3:  # the first timed step (after 2 warmup steps)
            time.sleep(1.0)
            clock["s"] += 1.0
        return real_step(self, batch)

    monkeypatch.setattr(Trainer, "train_step", step)
    monkeypatch.setattr(runner, "kernel_setup_seconds", lambda: clock["s"])
    cfg = compose(["profile.steps=2", "profile.warmup_steps=2", "run.progress=false"])
    validate(cfg)
    out = profile(Trainer(cfg), out_root=str(tmp_path))
    assert out["setup_s_in_timed_steps"] == 1.0
    assert out["step_time_s"] < 0.5, out["step_time_s"]
