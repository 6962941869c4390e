"""The `gemctl` command line, run as a subprocess: one-line errors with exit code 2, no
tracebacks, and the config / recipes verbs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def gemctl(*args: str, cwd: Path = REPO, columns: int = 200) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["COLUMNS"] = str(columns)  # rich tables: keep each recipe on its own line
    env.setdefault("GEMCTL_THREADS", "2")
    return subprocess.run(
        [sys.executable, "-m", "gemctl", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, prefix: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stdout and "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"gemctl: error: {prefix}"), lines[0]
    return lines[0]


def test_unknown_key():
    line = assert_one_line_error(gemctl("config", "validate", "train.stpes=3"), "train.stpes")
    assert "did you mean 'steps'" in line


def test_unknown_group_option():
    line = assert_one_line_error(gemctl("config", "validate", "model=huge"), "model")
    assert line == "gemctl: error: model: no config 'huge'; allowed: gem_1b, small, tiny"


def test_unknown_recipe():
    line = assert_one_line_error(gemctl("config", "validate", "--recipe", "nope"), "recipe")
    assert "no recipe 'nope'" in line and "cpu_smoke" in line and "small_h200" in line


def test_bad_attention_kind():
    line = assert_one_line_error(gemctl("config", "validate", "model.attention=[window]"), "model.attention[0]")
    assert "'window' is not allowed; allowed: full | block:<block_size>" in line


@pytest.mark.parametrize("override,line", [
    ("train.lr=1e-3,3e-3", "train.lr: '1e-3,3e-3' gives several values: add -m to sweep them, or quote it as "
                           "train.lr='1e-3,3e-3'"),
    ("train.betas=0.9,0.95", "train.betas: '0.9,0.95' gives several values: add -m to sweep them, or write a list "
                             "as train.betas=[0.9,0.95]"),
    ("model=small,tiny", "model: 'small,tiny' gives several options: add -m to run one job each"),
    ("model.attention=window:16", "model.attention: a list is expected, e.g. model.attention=[window:16]"),
    ("train.steps=abc", "train.steps: 'abc' is not an integer"),
    ("train.lr=fast", "train.lr: 'fast' is not a number"),
    ("run.progress=maybe", "run.progress: 'maybe' is not true or false"),
])
def test_type_errors_say_what_the_field_takes(override, line):
    assert assert_one_line_error(gemctl("config", "validate", override), "") == f"gemctl: error: {line}"


def test_broken_recipe_yaml_names_file_and_line(tmp_path):
    (tmp_path / "bad.yaml").write_text("train: {steps: [\n")
    line = assert_one_line_error(gemctl("config", "validate", "--recipe", str(tmp_path / "bad.yaml")), "recipe: ")
    assert f"{tmp_path / 'bad.yaml'}, line 2: not valid YAML (while parsing a flow node" in line


def test_unknown_key_in_precision_rule():
    proc = gemctl("config", "validate", "precision.rules=[{match: '*', fmt: bf16}]")
    line = assert_one_line_error(proc, "precision.rules[0].fmt")
    assert "did you mean 'format'" in line


def test_validate_ok():
    proc = gemctl("config", "validate")
    assert proc.returncode == 0, proc.stderr
    assert "config is valid" in proc.stdout
    assert proc.stderr == ""


def test_config_show_is_yaml():
    proc = gemctl("config", "show", "model=small")
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["model"]["name"] == "small"
    assert cfg["model"]["d_model"] == 768
    assert cfg["model"]["head_dim"] == 128
    assert cfg["data"]["source"] == "synthetic"
    assert cfg["precision"]["rules"][-1] == {"match": "heads.*", "format": "fp32", "last_n_layers": None}


@pytest.mark.parametrize("args", [("recipes", "list"), ("recipes",)])  # list is the default action
def test_recipes_list(args):
    proc = gemctl(*args)
    assert proc.returncode == 0, proc.stderr
    assert "cpu_smoke" in proc.stdout
    assert "small_h200" in proc.stdout
    assert "gemctl train --recipe cpu_smoke" in proc.stdout


def test_recipe_summary_is_the_command_and_a_whole_first_sentence():
    from gemctl.cli import recipe_summary

    text = ("# @package _global_\n# gemctl train --recipe x -m\n# Does a thing (v1.2, seed 0) over\n"
            "# two lines. Then more.\n#\n# Later paragraph.\ndefaults: []\n")
    assert recipe_summary(text) == "gemctl train --recipe x -m\nDoes a thing (v1.2, seed 0) over two lines."
    assert recipe_summary("# gemctl train --recipe y\n# No period at the end\n") == (
        "gemctl train --recipe y\nNo period at the end")


def test_verbs_used_wrongly():
    proc = gemctl("config")
    assert proc.returncode == 2 and proc.stderr.strip().endswith("the following arguments are required: action")
    assert_one_line_error(gemctl("recipes", "list", "extra"), "gemctl recipes list: takes no name (got 'extra')")
    assert_one_line_error(gemctl("recipes", "show", "cpu_smoke", "extra"), "gemctl recipes show: one recipe at a time")
    proc = gemctl("config", "show", "--recipe", "cpu_smoke", "train.steps=7")  # overrides after an option
    assert proc.returncode == 0 and yaml.safe_load(proc.stdout)["train"]["steps"] == 7, proc.stderr
    proc = gemctl("config", "show", "--recipe", "cpu_smoke", "--bogus")
    assert proc.returncode == 2 and "unrecognized arguments: --bogus" in proc.stderr


def test_recipes_show():
    proc = gemctl("recipes", "show", "cpu_smoke")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (REPO / "recipes" / "cpu_smoke.yaml").read_text()


def test_recipes_show_unknown():
    assert_one_line_error(gemctl("recipes", "show", "cpu_smok"), "recipe: no recipe 'cpu_smok' (did you mean 'cpu_smoke'?)")


def test_recipes_cp_and_use_as_path(tmp_path):
    dest = tmp_path / "mine.yaml"
    proc = gemctl("recipes", "cp", "cpu_smoke", str(dest))
    assert proc.returncode == 0, proc.stderr
    assert dest.read_text() == (REPO / "recipes" / "cpu_smoke.yaml").read_text()

    again = gemctl("recipes", "cp", "cpu_smoke", str(dest))
    line = assert_one_line_error(again, "gemctl recipes cp:")
    assert "exists" in line

    # The copy, edited, works as a recipe given by path.
    dest.write_text(dest.read_text().replace("steps: 40", "steps: 17"))
    proc = gemctl("config", "show", "--recipe", str(dest))
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["train"]["steps"] == 17
    assert cfg["train"]["device"] == "cpu"
    assert cfg["run"]["name"] == "cpu_smoke"
    assert cfg["data"]["synthetic"]["eval_samples"] == 1024


def test_recipes_cp_into_directory(tmp_path):
    proc = gemctl("recipes", "cp", "small_h200", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "small_h200.yaml").read_text() == (REPO / "recipes" / "small_h200.yaml").read_text()


def test_recipes_cp_destinations(tmp_path):
    """A name without .yaml gets it (--recipe takes a path only as a YAML file), a destination
    ending in / is a directory made on the way, a missing parent directory is one line."""
    proc = gemctl("recipes", "cp", "cpu_smoke", "mine", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "mine.yaml").is_file() and "--recipe mine.yaml" in proc.stdout
    assert gemctl("config", "validate", "--recipe", "mine.yaml", cwd=tmp_path).returncode == 0
    proc = gemctl("recipes", "cp", "cpu_smoke", "sub/", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "sub" / "cpu_smoke.yaml").is_file()
    line = assert_one_line_error(gemctl("recipes", "cp", "cpu_smoke", "nowhere/x.yaml", cwd=tmp_path),
                                 "gemctl recipes cp: directory nowhere does not exist")
    assert not (tmp_path / "nowhere").exists(), line
    (tmp_path / "afile").write_text("hi")
    assert_one_line_error(gemctl("recipes", "cp", "cpu_smoke", "afile/x/", cwd=tmp_path), "gemctl recipes cp: ")
    proc = gemctl("recipes", "cp", "cpu_smoke", "other.yml", cwd=tmp_path)  # .yml is kept, and works as a recipe
    assert proc.returncode == 0 and (tmp_path / "other.yml").is_file(), proc.stderr
    assert gemctl("config", "validate", "--recipe", "other.yml", cwd=tmp_path).returncode == 0


def test_a_sweep_recipe_without_m_says_so():
    """A recipe that declares a sweep, run without -m, runs one job: the command says so (here
    through the Slurm dry run, which prints the job script and submits nothing)."""
    slurm = ("launcher=slurm", "launcher.nnodes=1", "launcher.nproc_per_node=1", "--dry-run")
    proc = gemctl("train", "--recipe", "ablation_attention", *slurm)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith("gemctl: note: recipe ablation_attention sweeps ")  # stdout is the job script
    assert "a multirun runs on launcher=local or torchrun" in proc.stderr and "note" not in proc.stdout
    proc = gemctl("train", "--recipe", "cpu_smoke", *slurm)
    assert proc.returncode == 0 and "note: recipe" not in proc.stderr, proc.stderr


def test_train_prints_its_summary_and_unwrapped_paths(tmp_path):
    # a results line longer than the console's 100 columns must still come out whole (a pipe gets 80)
    out = tmp_path / ("o" * 60)  # the results line is then well over the 100 columns
    proc = gemctl("train", "train.steps=4", "train.warmup_timing_steps=1", "train.log_every=2", f"run.output_dir={out}",
                  "data.synthetic.eval_samples=64", "data.eval_batch_size=64", "run.progress=false", cwd=tmp_path,
                  columns=100)
    assert proc.returncode == 0, proc.stderr
    assert "train loss (mean of the last 4 steps)" in proc.stdout
    (results,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("results: ")]
    assert len(results) > 150 and results.endswith("/metrics.jsonl"), results  # one line, not wrapped
    assert Path(results.split()[1].rstrip(",")).is_file(), results


def test_output_dir_that_is_a_file(tmp_path):
    (tmp_path / "afile").write_text("hi")
    for verb in (("config", "validate"), ("train",)):
        assert_one_line_error(gemctl(*verb, "run.output_dir=afile", cwd=tmp_path),
                              "run.output_dir: afile is a file; runs go into a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    assert_one_line_error(gemctl("config", "validate", "run.output_dir=.", "run.name=afile/sub", cwd=tmp_path),
                          "run.name: afile is a file")


def test_config_of_a_cuda_recipe_on_a_machine_without_one():
    """`config show` and `config validate` check the config, not this machine's devices."""
    proc = gemctl("config", "show", "--recipe", "small_h200")
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["train"]["device"] == "cuda"
    proc = gemctl("config", "validate", "--recipe", "small_h200")
    assert proc.returncode == 0 and proc.stdout.startswith("config is valid"), proc.stderr


def test_a_shown_config_is_a_recipe(tmp_path):
    """`gemctl config show`'s output (and a run's config.yaml) has no package line; as --recipe it
    composes to the same config."""
    shown = gemctl("config", "show", "model=small", "train.steps=9")
    assert shown.returncode == 0, shown.stderr
    (tmp_path / "full.yaml").write_text(shown.stdout)
    again = gemctl("config", "show", "--recipe", str(tmp_path / "full.yaml"))
    assert again.returncode == 0, again.stderr
    assert yaml.safe_load(again.stdout) == yaml.safe_load(shown.stdout)
    # its whole model block would silently beat a model group picked on the command line: refused
    line = assert_one_line_error(gemctl("config", "show", "--recipe", str(tmp_path / "full.yaml"), "model=gem_1b"),
                                 "model: model=gem_1b would not apply:")
    assert "override its fields (model.<field>=...)" in line
    fields = gemctl("config", "show", "--recipe", str(tmp_path / "full.yaml"), "model.d_model=64")
    assert fields.returncode == 0 and yaml.safe_load(fields.stdout)["model"]["d_model"] == 64, fields.stderr


@pytest.mark.parametrize("overrides", [["train.stpes=3"], ["model=huge"], ["model.head_dim=20"]])
def test_bad_config_creates_no_run_directory(tmp_path, overrides):
    proc = gemctl("train", *overrides, cwd=tmp_path)
    assert_one_line_error(proc, overrides[0].split("=")[0])
    assert not (tmp_path / "runs").exists()
    assert list(tmp_path.iterdir()) == []


def test_torchrun_resume_of_nothing_fails_before_a_run_directory(tmp_path):
    """launcher=torchrun with a train.resume path that holds no checkpoint: one line, exit 2, and
    neither a run directory nor a torchrun start (the ranks used to fail on it one by one)."""
    runs = tmp_path / "runs"
    proc = gemctl("train", "launcher=torchrun", "launcher.nproc_per_node=2", "parallel=fsdp", f"run.output_dir={runs}",
                  f"train.resume={tmp_path / 'nothing'}")
    assert_one_line_error(proc, "train.resume: no published checkpoint")
    assert not runs.exists() and "launching" not in proc.stdout
