"""`gemctl train -m`: one run directory per combination, a sweep table, and every job validated
before the first one runs."""

import json
import os
import subprocess
import sys

import pytest

from gemctl.launch.multirun import comparison_rows, expand, markdown_table, recipe_sweep, summary_markdown, summary_rows

SHORT = ["train.steps=4", "train.warmup_timing_steps=1", "train.log_every=2", "data.synthetic.eval_samples=64",
         "data.eval_batch_size=64", "data.batch_size=16", "run.progress=false"]


def test_expand_is_the_cartesian_product():
    jobs = expand(["model.num_layers=1,2", "train.lr=range(1,4)", "model=tiny"])
    assert len(jobs) == 6
    assert jobs[0] == ["model.num_layers=1", "train.lr=1", "model=tiny"]
    assert jobs[-1] == ["model.num_layers=2", "train.lr=3", "model=tiny"]


def test_run_directories_started_in_the_same_second_are_distinct(tmp_path, monkeypatch):
    # two multiruns launched together once collided on renaming their directories to one name
    from gemctl.metrics import sinks

    monkeypatch.setattr(sinks.time, "strftime", lambda fmt, *a: "20260101-000000")
    made = [sinks.RunDir.create(tmp_path, "ablation", prefix="multirun-").path for _ in range(3)]
    made.append(sinks.RunDir.create(tmp_path, "ablation").path)
    assert [p.name for p in made] == ["multirun-20260101-000000", "multirun-20260101-000000-2",
                                      "multirun-20260101-000000-3", "20260101-000000"]
    assert all(p.is_dir() and not os.listdir(p) for p in made)


def test_multirun_one_directory_per_job(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gemctl", "train", "-m", "model.num_layers=1,2",
                           f"run.output_dir={tmp_path}", *SHORT], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (sweep_dir,) = os.listdir(tmp_path / "default")
    root = tmp_path / "default" / sweep_dir
    assert sweep_dir.startswith("multirun-") and sorted(os.listdir(root)) == ["0", "1", "sweep.json", "sweep.md"]
    sweep = json.loads((root / "sweep.json").read_text())
    assert sweep["keys"] == ["model.num_layers"]
    assert [j["overrides"][0] for j in sweep["jobs"]] == ["model.num_layers=1", "model.num_layers=2"]
    for job in sweep["jobs"]:
        assert job["exit_code"] == 0 and 0 < job["eval"]["ctr"]["auc"] < 1
        summary = json.loads((root / str(job["job"]) / "summary.json").read_text())
        assert summary["eval"] == job["eval"]
        # what the numbers belong to: the code and the stack, in the run and in the sweep
        import torch

        from gemctl.metrics.provenance import source_commit

        assert summary["provenance"]["torch"] == torch.__version__
        assert summary["provenance"]["commit"] == source_commit()  # the checkout the run came from
        assert job["provenance"] == summary["provenance"]
        assert job["grad_norm"] == summary["grad_norm"] and summary["grad_norm"]["grad_norm_max"] > 0
    assert "| max grad norm | clipped steps |" in (root / "sweep.md").read_text()


def test_multirun_validates_every_job_first(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gemctl", "train", "-m", "model.num_layers=1,0",
                           f"run.output_dir={tmp_path}", *SHORT], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "gemctl: error: model.num_layers: must be > 0, got 0 (multirun job 1: model.num_layers=0 "
        + " ".join([f"run.output_dir={tmp_path}", *SHORT]) + ")"
    ]
    assert not os.listdir(tmp_path)


def test_a_failed_job_is_recorded_and_the_sweep_goes_on(tmp_path):
    """A job that fails at run time (here: a checkpoint that does not exist) gets its exit code in
    the sweep's record and table, and the jobs after it still run."""
    missing = tmp_path / "no-such-checkpoint"
    proc = subprocess.run([sys.executable, "-m", "gemctl", "train", "-m", f"train.resume={missing},auto",
                           f"run.output_dir={tmp_path / 'out'}", *SHORT], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert f"gemctl: error: train.resume: no published checkpoint" in proc.stderr
    (sweep_dir,) = os.listdir(tmp_path / "out" / "default")
    sweep = json.loads((tmp_path / "out" / "default" / sweep_dir / "sweep.json").read_text())
    assert [j["exit_code"] for j in sweep["jobs"]] == [2, 0]
    assert "eval" not in sweep["jobs"][0] and 0 < sweep["jobs"][1]["eval"]["ctr"]["auc"] < 1
    assert "| 0 | " in proc.stdout and "exit 2" in proc.stdout


def test_a_torchrun_job_that_cannot_start_is_recorded_too(tmp_path, capsys):
    """Under launcher=torchrun the launcher refuses a train.resume of nothing before starting
    torchrun: the job gets exit code 2 and its one error line, like a local job, and the sweep
    goes on (the error used to escape the sweep's loop)."""
    from rich.console import Console

    from gemctl.config.compose import compose
    from gemctl.launch.multirun import _run_one

    cfg = compose(["launcher=torchrun", "launcher.nproc_per_node=2", "parallel=fsdp",
                   f"train.resume={tmp_path / 'nothing'}"])
    run_dir = tmp_path / "0"
    run_dir.mkdir()
    assert _run_one(cfg, run_dir, Console()) == 2
    assert "gemctl: error: train.resume: no published checkpoint" in capsys.readouterr().err
    assert list(run_dir.iterdir()) == []


def test_comparison_table_by_hand():
    results = [
        {"job": 0, "overrides": ["model.attention=[full]", "train.steps=4"], "exit_code": 0,
         "eval": {"samples": 64, "ctr": {"ne": 0.91234, "auc": 0.7}, "cvr": {"ne": 0.8, "auc": 0.75}},
         "perf": {"step_time_ms": 12.345, "qps": 1234.5, "local_mfu": 0.0123, "e2e_mfu": 0.0123}},
        {"job": 1, "overrides": ["model.attention=[window\\:256]", "train.steps=4"], "exit_code": 1},
    ]
    rows = comparison_rows(["model.attention"], results)
    assert rows[0] == {"job": 0, "model.attention": "[full]", "exit_code": 0, "ctr.ne": 0.91234, "ctr.auc": 0.7,
                       "cvr.ne": 0.8, "cvr.auc": 0.75, "step_time_ms": 12.345, "qps": 1234.5, "mfu": 0.0123}
    assert rows[1]["model.attention"] == "[window:256]"  # Hydra's escape of ':' is not shown
    assert markdown_table(["model.attention"], rows).splitlines() == [
        "| job | model.attention | ctr NE | ctr AUC | cvr NE | cvr AUC | step ms | QPS | MFU |",
        "|---|---|---|---|---|---|---|---|---|",
        "| 0 | [full] | 0.9123 | 0.7000 | 0.8000 | 0.7500 | 12.3 | 1,234 | 1.23% |",
        "| 1 | [window:256] | exit 1 |  |  |  |  |  |  |",
    ]


def test_gradient_norm_columns_where_recorded():
    """A job's largest gradient norm and clipped steps are columns when some job recorded them
    (older sweeps lack them, a job without clipping has none: '-')."""
    base = {"eval": {"ctr": {"ne": 0.9, "auc": 0.7}}, "perf": {"step_time_ms": 10.0, "qps": 100.0, "local_mfu": 0.1}}
    results = [
        {"job": 0, "overrides": ["precision=bf16"], "exit_code": 0, **base,
         "grad_norm": {"grad_norm_max": 3.21987, "grad_norm_mean": 0.5, "clipped_steps": 7}},
        {"job": 1, "overrides": ["precision=fp8_mlp"], "exit_code": 0, **base, "grad_norm": {}},
        {"job": 2, "overrides": ["precision=fp8"], "exit_code": 0, **base,
         "grad_norm": {"grad_norm_max": 9.5, "grad_norm_mean": 2.0, "clipped_steps": 3, "nonfinite_norm_steps": 1}},
    ]
    rows = comparison_rows(["precision"], results)
    assert rows[0]["grad_norm_max"] == 3.21987 and rows[0]["clipped_steps"] == 7 and "grad_norm_max" not in rows[1]
    lines = markdown_table(["precision"], rows).splitlines()
    assert lines[0].endswith("| MFU | max grad norm | clipped steps |")
    assert lines[2].endswith("| 3.22 | 7 |") and lines[3].endswith("| - | - |")
    assert lines[4].endswith("| 9.5 | 3 (+1 non-finite) |")
    without = comparison_rows(["precision"], [{**r, "grad_norm": None} for r in results])
    assert "max grad norm" not in markdown_table(["precision"], without)


def test_checkpoint_sweep_shows_hfu_and_peak_memory():
    """A sweep over activation checkpointing shows HFU (where the recomputation is known; budget's
    is not: '-') and each job's peak GPU memory beside its step time."""
    ev = {"ctr": {"ne": 0.9, "auc": 0.7}}
    perf = {"step_time_ms": 10.0, "qps": 100.0, "local_mfu": 0.3, "hfu": 0.3, "activation_checkpoint": "none",
            "peak_memory_gib": 20.04}
    results = [
        {"job": 0, "overrides": ["parallel.activation_checkpoint.mode=none"], "exit_code": 0, "eval": ev, "perf": perf},
        {"job": 1, "overrides": ["parallel.activation_checkpoint.mode=full"], "exit_code": 0, "eval": ev,
         "perf": {**perf, "hfu": 0.3812, "activation_checkpoint": "full: 4 of 4 tower layers", "peak_memory_gib": 7.51}},
        {"job": 2, "overrides": ["parallel.activation_checkpoint.mode=budget"], "exit_code": 0, "eval": ev,
         "perf": {**perf, "hfu": None, "activation_checkpoint": "budget: ...", "peak_memory_gib": 9.0}},
    ]
    lines = markdown_table(["parallel.activation_checkpoint.mode"], comparison_rows(
        ["parallel.activation_checkpoint.mode"], results)).splitlines()
    assert lines[0].endswith("| MFU | HFU | peak memory |")
    assert lines[2].endswith("| 30.00% | - | 20.0 GiB |")
    assert lines[3].endswith("| 30.00% | 38.12% | 7.5 GiB |")
    assert lines[4].endswith("| 30.00% | - | 9.0 GiB |")
    cpu = [{**r, "perf": {k: v for k, v in perf.items() if k != "peak_memory_gib"}} for r in results[:1]]
    assert "peak memory" not in markdown_table(["x"], comparison_rows(["x"], cpu))


def _job(i, precision, seed, ctr_ne, step_ms=10.0, code=0):
    job = {"job": i, "overrides": [f"precision={precision}", f"train.seed={seed}"], "exit_code": code}
    if code == 0:
        job.update(eval={"ctr": {"ne": ctr_ne, "auc": 0.8}}, perf={"step_time_ms": step_ms, "qps": 1.0, "local_mfu": 0.1})
    return job


def test_settings_compared_over_seeds():
    """The per-setting table: mean ± std over seeds, the difference from the first setting against
    max(0.1% of its mean, 2 std of its seeds), paired per-seed differences, speed-up."""
    keys = ["precision", "train.seed"]
    results = [_job(0, "bf16", 0, 0.70), _job(1, "bf16", 1, 0.71), _job(2, "bf16", 2, 0.72, step_ms=20.0),
               _job(3, "fp8", 0, 0.72, 5.0), _job(4, "fp8", 1, 0.73, 5.0), _job(5, "fp8", 2, 0.74, 10.0),
               _job(6, "mx", 0, 0.705), _job(7, "mx", 1, 0, code=1), _job(8, "mx", 2, 0.725)]
    groups = summary_rows(keys, comparison_rows(keys, results))
    assert [g["precision"] for g in groups] == ["bf16", "fp8", "mx"]
    bf16, fp8, mx = groups
    assert bf16["ctr.ne_mean"] == pytest.approx(0.71) and bf16["ctr.ne_std"] == pytest.approx(0.01)
    assert bf16["ctr.ne_bar"] == pytest.approx(0.02)  # 2 std of the baseline seeds > 0.1% of 0.71
    assert fp8["ctr.ne_diff_rel"] == pytest.approx(0.02 / 0.71) and fp8["ctr.verdict"] == "worse"
    assert fp8["ctr.paired_mean"] == pytest.approx(0.02) and fp8["ctr.paired_std"] == pytest.approx(0.0)
    assert fp8["speedup"] == pytest.approx((40 / 3) / (20 / 3))
    assert mx["n"] == 2 and mx["ctr.verdict"] == "neutral"  # the failed seed is left out
    assert mx["ctr.paired_mean"] == pytest.approx(0.005)
    md = summary_markdown(keys, groups).splitlines()
    assert md[2] == "| precision | runs | ctr NE | ctr NE vs first | ctr paired diff | ctr AUC | step ms | speed-up |"
    assert md[4] == "| bf16 | 3 | 0.7100 ± 0.0100 | bar 0.0200 | - | 0.8000 | 13.3 | 1.00x |"
    assert md[5] == "| fp8 | 3 | 0.7300 ± 0.0100 | +2.82% worse | 0.0200 ± 0.0000 | 0.8000 | 6.7 | 2.00x |"
    assert summary_rows(keys, comparison_rows(keys, results[:3])) == []  # one setting: nothing to compare
    # The first setting is the baseline even when it is not the largest; if all its jobs failed,
    # there is no comparison rather than a silent new baseline.
    failed_first = [_job(0, "bf16", 0, 0, code=1), _job(1, "bf16", 1, 0, code=1)] + results[3:]
    assert summary_rows(keys, comparison_rows(keys, failed_first)) == []
    # An undefined NE (NaN: one class in the eval labels) gets no verdict instead of "better".
    nan_ne = results[:6] + [_job(6, "mx", 0, float("nan")), _job(7, "mx", 1, float("nan"))]
    mx = summary_rows(keys, comparison_rows(keys, nan_ne))[2]
    assert "ctr.verdict" not in mx and "ctr NE" in summary_markdown(keys, [bf16, fp8, mx])


def test_one_baseline_seed_gives_no_verdict():
    """One seed of the baseline has no spread: the difference is printed, but neither a bar nor a
    worse/better/neutral verdict (a single run's NE moves by percents between seeds)."""
    keys = ["precision", "train.seed"]
    results = [_job(0, "bf16", 0, 0.70), _job(1, "fp8", 0, 0.75), _job(2, "mx", 0, 0.7001)]
    bf16, fp8, mx = summary_rows(keys, comparison_rows(keys, results))
    assert bf16["ctr.ne_bar"] is None and fp8["ctr.verdict"] == mx["ctr.verdict"] == "unknown"
    md = summary_markdown(keys, [bf16, fp8, mx]).splitlines()
    assert "| no bar (1 seed) |" in md[4] and "+7.14% (no verdict: 1 baseline seed)" in md[5]


def test_recipe_declares_its_sweep(tmp_path):
    recipe = tmp_path / "kinds.yaml"
    recipe.write_text("# @package _global_\n# gemctl train --recipe kinds -m\n"
                      "hydra:\n  sweeper:\n    params:\n      model.attention: '[full],[window:2],[block:4]'\n"
                      "      train.seed: 0,1\n")
    assert recipe_sweep(str(recipe), ["train.seed=3"]) == ["model.attention=[full],[window:2],[block:4]"]
    proc = subprocess.run([sys.executable, "-m", "gemctl", "train", "--recipe", str(recipe), "-m", "train.seed=3",
                           "model.rope_base=10000", f"run.output_dir={tmp_path}", *SHORT],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (sweep_dir,) = os.listdir(tmp_path / "default")
    root = tmp_path / "default" / sweep_dir
    assert sorted(os.listdir(root)) == ["0", "1", "2", "sweep.json", "sweep.md"]
    sweep = json.loads((root / "sweep.json").read_text())
    assert sweep["keys"] == ["model.attention"]  # the command line's train.seed=3 replaced the recipe's sweep
    assert [row["model.attention"] for row in sweep["table"]] == ["[full]", "[window:2]", "[block:4]"]
    for row in sweep["table"]:
        assert row["exit_code"] == 0 and row["step_time_ms"] > 0 and row["qps"] > 0
        assert 0 < row["ctr.auc"] < 1 and row["ctr.ne"] > 0
    md = (root / "sweep.md").read_text()
    assert "| job | model.attention | ctr NE | ctr AUC | cvr NE | cvr AUC | step ms | QPS | MFU |" in md
    assert "| 1 | [window:2] |" in md
    assert "ctr NE" in proc.stdout and "step ms" in proc.stdout
    assert [g["model.attention"] for g in sweep["summary"]] == ["[full]", "[window:2]", "[block:4]"]
    assert "ctr NE vs first" in md and "ctr NE vs first" in proc.stdout


def _sweep(path, jobs):
    path.mkdir(parents=True)
    (path / "sweep.json").write_text(json.dumps({"keys": ["train.seed"], "jobs": jobs}))
    return path


def _variant(i, overrides, seed, ctr_ne):
    job = _job(i, "x", seed, ctr_ne)
    job["overrides"] = [*overrides, f"train.seed={seed}", "data=movielens100k"]
    return job


def test_compare_merges_multiruns(tmp_path, capsys):
    """`gemctl compare`: the jobs of several multiruns as one, a setting named by the overrides
    the jobs do not all share, the baseline chosen by name, a setting and seed met twice kept apart."""
    from gemctl.cli import main
    from gemctl.errors import UserError
    from gemctl.launch.multirun import merge_sweeps

    a = _sweep(tmp_path / "multirun-a", [_variant(i, ["precision=bf16"], i, 0.70 + i / 100) for i in range(3)]
               + [_variant(3 + i, ["precision=fp8_mlp"], i, 0.72 + i / 100) for i in range(3)])
    b = _sweep(tmp_path / "multirun-b", [_variant(i, ["precision=fp8_mlp", "precision.fp8.wgrad=bf16"], i,
                                                  0.70 + i / 100) for i in range(3)])
    keys, rows, groups = merge_sweeps([b, a / "sweep.json"], baseline="precision=bf16")
    assert keys == ["setting", "train.seed"]
    assert [g["setting"] for g in groups] == ["precision=bf16", "precision=fp8_mlp precision.fp8.wgrad=bf16",
                                               "precision=fp8_mlp"]  # data=movielens100k is shared: left out
    assert rows[0]["job"] == "multirun-a/0" and groups[1]["ctr.verdict"] == "neutral"
    assert groups[2]["ctr.paired_mean"] == pytest.approx(0.02)
    # the same setting and seed in two runs: the later run's jobs of that setting stay apart, all of them
    again = _sweep(tmp_path / "multirun-c", [_variant(0, ["precision=bf16"], 0, 0.69),
                                             _variant(1, ["precision=bf16"], 5, 0.69)])
    _, rows, _ = merge_sweeps([a, again])
    assert [r["setting"] for r in rows[-2:]] == ["precision=bf16 [multirun-c]"] * 2
    # ... but a rerun of a failed seed fills it in
    failed = _sweep(tmp_path / "multirun-e", [_variant(0, ["precision=bf16"], 0, 0.7),
                                              {**_variant(1, ["precision=bf16"], 1, 0), "exit_code": 1}])
    rerun = _sweep(tmp_path / "multirun-f", [_variant(0, ["precision=bf16"], 1, 0.71)])
    _, rows, groups = merge_sweeps([failed, rerun])
    assert {r["setting"] for r in rows} == {"precision=bf16 data=movielens100k"} and groups == []
    # a run given twice, or under two spellings, would count twice
    with pytest.raises(UserError, match=r"given twice"):
        merge_sweeps([a, a / "sweep.json"])
    # runs of different recipes differ in their setting even where their overrides agree
    data = json.loads((again / "sweep.json").read_text())
    (again / "sweep.json").write_text(json.dumps({**data, "recipe": "ablation_precision"}))
    _, rows, _ = merge_sweeps([a, again])
    assert rows[-1]["setting"] == "recipe=ablation_precision precision=bf16"
    # same-named runs under different parents get their parent in the name
    twin = _sweep(tmp_path / "other" / "multirun-a", [_variant(0, ["precision=fp8"], 0, 0.7)])
    _, rows, _ = merge_sweeps([a, twin])
    assert rows[0]["job"] == f"{tmp_path.name}/multirun-a/0" and rows[-1]["job"] == "other/multirun-a/0"
    with pytest.raises(UserError, match=r"--baseline bf16: names more than one setting; settings: precision=bf16; "):
        merge_sweeps([a, b], baseline="bf16")  # precision=bf16, and precision.fp8.wgrad=bf16
    assert merge_sweeps([a], baseline="fp8_mlp")[1][0]["setting"] == "precision=fp8_mlp"  # a value, unambiguous
    # a job that only the shared overrides would name: every setting keeps its whole list
    plain = _sweep(tmp_path / "multirun-d", [_variant(0, [], 0, 0.7)])
    _, rows, _ = merge_sweeps([plain, b])
    assert [r["setting"] for r in rows[:2]] == ["data=movielens100k",
                                                "precision=fp8_mlp precision.fp8.wgrad=bf16 data=movielens100k"]
    out = tmp_path / "cmp.json"
    assert main(["compare", str(a), str(b), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["summary"][0]["setting"] == "precision=bf16"
    assert "different code" not in capsys.readouterr().out  # no run recorded provenance: nothing to say
    assert main(["compare", str(a), "--out", str(tmp_path)]) == 2  # checked before any work
    assert capsys.readouterr().err.strip() == f"gemctl: error: gemctl compare: --out {tmp_path}: a directory; give a file path"
    # runs of two commits: said, with the number of jobs of each
    for path, commit in ((a, "abc1234"), (b, "def5678")):
        data = json.loads((path / "sweep.json").read_text())
        for job in data["jobs"]:
            job["provenance"] = {"commit": commit, "torch": "2.11.0", "triton": "3.6.0"}
        (path / "sweep.json").write_text(json.dumps(data))
    assert main(["compare", str(a), str(b)]) == 0
    assert ("note: the jobs ran on different code or libraries (commit abc1234, torch 2.11.0, triton 3.6.0: 6 jobs; "
            "commit def5678, torch 2.11.0, triton 3.6.0: 3 jobs)") in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("what, message", [
    ("missing", "gemctl: error: gemctl compare: {p}: no such file or directory (give a multirun directory or its "
                "sweep.json)"),
    ("not a sweep", "gemctl: error: gemctl compare: {p}/sweep.json: not the sweep.json of a gemctl multirun"),
    ("baseline", "gemctl: error: gemctl compare: --baseline fp16: names no setting; settings: precision=bf16 "
                 "data=movielens100k"),
    ("job shape", "gemctl: error: gemctl compare: {p}/sweep.json: not the sweep.json of a gemctl multirun"),
])
def test_compare_errors_are_one_line(tmp_path, capsys, what, message):
    from gemctl.cli import main

    p = tmp_path / "run"
    if what == "not a sweep":
        p.mkdir()
        (p / "sweep.json").write_text('{"table": []}')
    elif what == "job shape":  # overrides as one string, an eval without perf
        p.mkdir()
        (p / "sweep.json").write_text(json.dumps({"jobs": [{"overrides": "precision=bf16", "exit_code": 0}]}))
    elif what == "baseline":
        _sweep(p, [_variant(0, ["precision=bf16"], 0, 0.7)])
    args = ["compare", str(p)] + (["--baseline", "fp16"] if what == "baseline" else [])
    assert main(args) == 2
    assert capsys.readouterr().err.strip().splitlines() == [message.format(p=p)]


def test_source_commit(monkeypatch):
    from gemctl.metrics import provenance

    monkeypatch.setenv("GEMCTL_COMMIT", "0123abc")  # a copied tree names its commit
    assert provenance.provenance()["commit"] == "0123abc"
    monkeypatch.delenv("GEMCTL_COMMIT")
    monkeypatch.setattr(provenance, "_ROOT", provenance._ROOT / "no-such-checkout")
    assert provenance.source_commit() == "unknown"  # an installed package without git


def test_source_commit_of_a_checkout(monkeypatch, tmp_path):
    from gemctl.metrics import provenance

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                              capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "f.txt").write_text("a")
    git("add", "f.txt")
    git("commit", "-qm", "c")
    monkeypatch.delenv("GEMCTL_COMMIT", raising=False)
    monkeypatch.setattr(provenance, "_ROOT", tmp_path)
    head = git("rev-parse", "--short", "HEAD")
    assert provenance.source_commit() == head
    (tmp_path / "f.txt").write_text("b")  # a tracked file edited: the numbers are not the commit's
    assert provenance.source_commit() == f"{head}-dirty"
