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
    def __init__(self, has_timeout):
        self.pluginmanager = type("PM", (), {"hasplugin": staticmethod(lambda name: has_timeout and name == "timeout")})


def test_gpu_tests_get_a_watchdog_timeout(monkeypatch):
    """With pytest-timeout present every gpu test gets a thread-method limit (a signal cannot break a
    blocked CUDA call), one with its own limit keeps it, CPU tests get none; GEMCTL_GPU_TEST_TIMEOUT
    sets the limit and 0 turns it off; without the plugin nothing is added."""
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

    for env, has_plugin in (("0", True), ("45", False)):
        monkeypatch.setenv("GEMCTL_GPU_TEST_TIMEOUT", env)
        untouched = _Item(pytest.mark.gpu.mark)
        gpu_test_timeouts(_Config(has_plugin), [untouched])
        assert untouched.get_closest_marker("timeout") is None
