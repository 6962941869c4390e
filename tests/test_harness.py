"""The test harness itself (tests/conftest.py): what the GPU tier relies on to survive a hung kernel."""

import pytest

from conftest import gpu_test_timeouts


class _Item:
    def __init__(self, *marks):
        self.keywords = {m.name: m for m in marks}
        self.own = list(marks)

    def get_closest_marker(self, name):
        return next((m for m in reversed(self.own) if m.name == name), None)

    def add_marker(self, mark):
        self.own.append(mark.mark)


class _Config:
    def __init__(self, has_timeout, cli_timeout=None):
        self.pluginmanager = type("PM", (), {"hasplugin": staticmethod(lambda name: has_timeout and name == "timeout")})
        self.cli_timeout = cli_timeout

    def getoption(self, name, default=None):
        return self.cli_timeout if name == "timeout" else default


def test_gpu_tests_get_a_watchdog_timeout(monkeypatch):
    """With pytest-timeout present every gpu test gets a thread-method limit (a signal cannot break a
    blocked CUDA call), one with its own limit keeps it, CPU tests get none; GEMCTL_GPU_TEST_TIMEOUT
    sets the limit and 0 turns it off; without the plugin, or with pytest --timeout given (which a
    marker would override), nothing is added."""
    monkeypatch.delenv("GEMCTL_GPU_TEST_TIMEOUT", raising=False)
    gpu, own, cpu = _Item(pytest.mark.gpu.mark), _Item(pytest.mark.gpu.mark, pytest.mark.timeout(900).mark), _Item()
    gpu_test_timeouts(_Config(True), [gpu, own, cpu])
    mark = gpu.get_closest_marker("timeout")
    assert mark.args == (300,) and mark.kwargs == {"method": "thread"}
    assert own.get_closest_marker("timeout").args == (900,)
    assert cpu.get_closest_marker("timeout") is None

    monkeypatch.setenv("GEMCTL_GPU_TEST_TIMEOUT", "45")
    other = _Item(pytest.mark.gpu.mark)
    gpu_test_timeouts(_Config(True), [other])
    assert other.get_closest_marker("timeout").args == (45.0,)

    for env, config in (("0", _Config(True)), ("45", _Config(False)), ("45", _Config(True, cli_timeout=900.0))):
        monkeypatch.setenv("GEMCTL_GPU_TEST_TIMEOUT", env)
        untouched = _Item(pytest.mark.gpu.mark)
        gpu_test_timeouts(config, [untouched])
        assert untouched.get_closest_marker("timeout") is None


def test_hung_gpu_test_is_stopped_with_its_stack(pytester, monkeypatch):
    """End to end, as on the GPU machine (torch.cuda.is_available stubbed True in a copy of this
    conftest): a gpu test that blocks past GEMCTL_GPU_TEST_TIMEOUT is stopped by pytest-timeout's
    watchdog thread, which prints the test's stack, instead of hanging the run."""
    pytest.importorskip("pytest_timeout")
    from pathlib import Path

    conftest = (Path(__file__).parent / "conftest.py").read_text()
    pytester.makeconftest("import torch\ntorch.cuda.is_available = lambda: True\n" + conftest)
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n")
    pytester.makepyfile(test_hang="""
        import time
        import pytest

        @pytest.mark.gpu
        def test_blocks():
            time.sleep(60)
    """)
    monkeypatch.setenv("GEMCTL_GPU_TEST_TIMEOUT", "1")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=50)
    out = result.stdout.str() + result.stderr.str()
    assert result.ret != 0
    assert "Timeout" in out and "test_blocks" in out and "time.sleep(60)" in out
