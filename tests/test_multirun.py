"""`gemctl train -m`: one run directory per combination, a sweep table, and every job validated
before the first one runs."""

import json
import os
import subprocess
import sys

from gemctl.launch.multirun import expand

SHORT = ["train.steps=4", "train.warmup_timing_steps=1", "train.log_every=2", "data.synthetic.eval_samples=64",
         "data.eval_batch_size=64", "data.batch_size=16", "run.progress=false"]


def test_expand_is_the_cartesian_product():
    jobs = expand(["model.num_layers=1,2", "train.lr=range(1,4)", "model=tiny"])
    assert len(jobs) == 6
    assert jobs[0] == ["model.num_layers=1", "train.lr=1", "model=tiny"]
    assert jobs[-1] == ["model.num_layers=2", "train.lr=3", "model=tiny"]


def test_multirun_one_directory_per_job(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gemctl", "train", "-m", "model.num_layers=1,2",
                           f"run.output_dir={tmp_path}", *SHORT], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (sweep_dir,) = os.listdir(tmp_path / "default")
    root = tmp_path / "default" / sweep_dir
    assert sweep_dir.startswith("multirun-") and sorted(os.listdir(root)) == ["0", "1", "sweep.json"]
    sweep = json.loads((root / "sweep.json").read_text())
    assert sweep["keys"] == ["model.num_layers"]
    assert [j["overrides"][0] for j in sweep["jobs"]] == ["model.num_layers=1", "model.num_layers=2"]
    for job in sweep["jobs"]:
        assert job["exit_code"] == 0 and 0 < job["eval"]["ctr"]["auc"] < 1
        summary = json.loads((root / str(job["job"]) / "summary.json").read_text())
        assert summary["eval"] == job["eval"]


def test_multirun_validates_every_job_first(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gemctl", "train", "-m", "model.num_layers=1,0",
                           f"run.output_dir={tmp_path}", *SHORT], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "gemctl: error: model.num_layers: must be > 0, got 0 (multirun job 1: model.num_layers=0 "
        + " ".join([f"run.output_dir={tmp_path}", *SHORT]) + ")"
    ]
    assert not os.listdir(tmp_path)
