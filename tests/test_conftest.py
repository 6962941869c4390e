"""The test harness itself: how xdist workers share the cores, and the per-test compile log."""

import pytest

from conftest import worker_threads


def test_xdist_workers_share_the_cores():
    assert worker_threads(16, "16") == 1
    assert worker_threads(16, "4") == 4
    assert worker_threads(16, "6") == 2
    assert worker_threads(2, "8") == 1  # more workers than cores: one thread each, never 0


def test_outside_xdist_torch_keeps_its_default():
    assert worker_threads(16, None) is None
    assert worker_threads(None, "4") is None


def test_compile_log_writes_a_line_per_test(tmp_path):
    """GEMCTL_TEST_LOG: each test's outcome, wall time and the Triton compiles in it (the hooks are
    driven by hand here: the interpreter compiles nothing)."""
    import types

    from compile_log import CompileLog

    log = CompileLog(tmp_path / "log")
    log.pytest_runtest_setup(None)
    log.before_compile(key=None)
    log.after_compile(fn=types.SimpleNamespace(name="_kernel_b"))
    log.before_compile(key=None)
    log.after_compile(fn=types.SimpleNamespace(name="_kernel_a"))
    log.pytest_runtest_logreport(types.SimpleNamespace(when="call", outcome="passed", nodeid="t.py::test_x"))
    log.pytest_runtest_setup(None)  # the next test starts from zero
    log.pytest_runtest_logreport(types.SimpleNamespace(when="call", outcome="failed", nodeid="t.py::test_y"))
    lines = [line.split("\t") for line in log.path.read_text().splitlines()]
    assert [(x[0], x[1], x[3], x[5]) for x in lines] == [("t.py::test_x", "passed", "2", "_kernel_a,_kernel_b"),
                                                         ("t.py::test_y", "failed", "0", "")]
    assert all(float(x[2]) >= float(x[4]) >= 0 for x in lines)


def test_compile_log_from_the_environment(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}  # a plain run, even under -n
    env["GEMCTL_TEST_LOG"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"{__file__}::test_xdist_workers_share_the_cores"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = (tmp_path / "tests_main.tsv").read_text().splitlines()
    assert line.startswith("tests/test_conftest.py::test_xdist_workers_share_the_cores\tpassed\t")


def test_compile_log_chains_onto_installed_hooks(tmp_path, monkeypatch):
    """Hooks set before (gemctl.ops.triton.common times compiles with them) keep running."""
    import types

    knobs = pytest.importorskip("triton").knobs
    from compile_log import CompileLog

    calls = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: calls.append("before") or None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: calls.append("after"))
    log = CompileLog(tmp_path)
    assert log.install()
    assert knobs.runtime.jit_cache_hook(key=1) is None  # None: Triton goes on to compile
    knobs.runtime.jit_post_compile_hook(key=1, fn=types.SimpleNamespace(name="_k"))
    assert calls == ["before", "after"] and log.compiles == 1 and log.kernels == {"_k"}
