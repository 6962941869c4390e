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


def gemctl(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["COLUMNS"] = "200"  # rich tables: keep each recipe on its own line
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


def test_recipes_list():
    proc = gemctl("recipes", "list")
    assert proc.returncode == 0, proc.stderr
    assert "cpu_smoke" in proc.stdout
    assert "small_h200" in proc.stdout
    assert "gemctl train --recipe cpu_smoke" in proc.stdout


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


@pytest.mark.parametrize("overrides", [["train.stpes=3"], ["model=huge"], ["model.head_dim=20"]])
def test_bad_config_creates_no_run_directory(tmp_path, overrides):
    proc = gemctl("train", *overrides, cwd=tmp_path)
    assert_one_line_error(proc, overrides[0].split("=")[0])
    assert not (tmp_path / "runs").exists()
    assert list(tmp_path.iterdir()) == []
