"""Data-parallel layouts on CPU (gloo, several torchrun processes): FSDP over 2 ranks and HSDP 2x2
train the same losses as one process at the same global batch, and `gemctl train
launcher=torchrun` works end to end (one run directory, rank-0 summary with the global numbers).

Same global batch: every run uses Base Batch Shuffling with sub-batches of 8 samples, so a step
covers the same sample units whatever the world size (one process takes all of them); FSDP and
HSDP average gradients over ranks, and each rank's loss is its local mean, so the global loss is
the mean over ranks. What differs is the order of floating-point reductions.
"""

import glob
import json
import os
import subprocess
import sys

import pytest

from gemctl.config.compose import compose
from gemctl.config.validate import validate

COMMON = [
    "train.steps=8", "train.warmup_timing_steps=2", "train.log_every=2", "run.progress=false",
    "shuffle=bbs", "shuffle.sub_batch_size=8", "data.synthetic.eval_samples=64", "data.eval_batch_size=64",
]
# fp32 on CPU, reductions in another order: measured max relative difference 1.2e-7 (FSDP 2) and
# 1.2e-7 (HSDP 2x2) over the 8 steps; a wrong gradient average or a lost sample is >= 1e-2.
RTOL = 1e-5


def _torchrun(tmp_path, nproc: int, overrides: list[str]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "gemctl", "train", "launcher=torchrun", f"launcher.nproc_per_node={nproc}",
           f"run.output_dir={tmp_path}", *COMMON, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (summary,) = glob.glob(str(tmp_path / "default" / "*" / "summary.json"))
    return json.loads(open(summary).read())


def _single(tmp_path, overrides: list[str]) -> dict:
    from gemctl.train.trainer import train

    cfg = compose(COMMON + overrides)
    validate(cfg)
    result = train(cfg, run_root=str(tmp_path / "single"))
    return {"losses": result.losses, "perf": result.perf}


def _assert_close(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= RTOL * abs(b), f"step {i + 1}: {a} vs {b}"


@pytest.mark.parametrize("nproc,layout,global_batch", [
    (2, ["parallel=fsdp"], 16),
    (4, ["parallel=hsdp", "parallel.dp_shard=2", "parallel.topology.gpus_per_node=2"], 32),
], ids=["fsdp-2", "hsdp-2x2"])
def test_layout_matches_single_process(tmp_path, nproc, layout, global_batch):
    dist = _torchrun(tmp_path, nproc, layout + ["data.batch_size=8"])
    single = _single(tmp_path, [f"data.batch_size={global_batch}"])
    _assert_close(dist["losses"], single["losses"])
    perf = dist["perf"]
    assert perf["world_size"] == nproc and perf["local_mfu"] is None
    # Global counts: the summed samples over the timed steps at the global batch.
    assert perf["qps"] == pytest.approx(perf["qps_per_rank"] * nproc)
    assert perf["qps"] * perf["step_time_ms"] / 1e3 == pytest.approx(global_batch, rel=1e-6)


def test_torchrun_run_directory(tmp_path):
    summary = _torchrun(tmp_path, 2, ["parallel=fsdp", "data.batch_size=8"])
    (run,) = glob.glob(str(tmp_path / "default" / "*"))
    assert sorted(os.listdir(run)) == ["config.yaml", "metrics.jsonl", "summary.json"]
    assert summary["eval"]["samples"] == 64


def test_scaling_ratio_from_the_single_rank_baseline(tmp_path):
    summary = _torchrun(tmp_path, 2, ["parallel=fsdp", "data.batch_size=8", "metrics.scaling_baseline_steps=3"])
    perf = summary["perf"]
    assert perf["local_baseline"]["steps"] == 3 and perf["local_baseline"]["model_tflops"] > 0
    assert 0 < perf["scaling_ratio"] and 0 < perf["local_mfu"] < 1
    assert perf["e2e_mfu"] == pytest.approx(perf["local_mfu"] * perf["scaling_ratio"], rel=1e-9)
    # The baseline trains a copy: the job's own losses are those of a run without it.
    plain = _torchrun(tmp_path / "plain", 2, ["parallel=fsdp", "data.batch_size=8"])
    assert summary["losses"] == plain["losses"]


def test_torchrun_command_static_rendezvous():
    from pathlib import Path

    from gemctl.launch.torchrun import torchrun_command

    cfg = compose(["launcher=torchrun", "parallel=fsdp", "launcher.nnodes=2", "launcher.node_rank=1",
                   "launcher.rdzv_endpoint=node0:29400"])
    validate(cfg)
    cmd = torchrun_command(cfg, Path("run/config.yaml"))
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert cmd[3:] == ["--nproc_per_node=8", "--nnodes=2", "--max_restarts=0", "--node_rank=1",
                       "--master_addr=node0", "--master_port=29400", "-m", "gemctl.launch.worker", "run/config.yaml"]


def test_mis_sized_layout_fails_before_launch(tmp_path):
    cmd = [sys.executable, "-m", "gemctl", "train", "launcher=torchrun", "launcher.nproc_per_node=3",
           "parallel=hsdp", "parallel.dp_shard=2", f"run.output_dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "gemctl: error: parallel.dp_shard: 2 does not divide the world size 3 (launcher), so "
        "parallel.dp_replicate=-1 cannot fill it"
    ]
    assert not os.listdir(tmp_path)  # nothing written
