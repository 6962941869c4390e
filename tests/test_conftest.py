"""The test harness itself: how xdist workers share the machine's cores."""

from conftest import worker_threads


def test_xdist_workers_share_the_cores():
    assert worker_threads(16, "16") == 1
    assert worker_threads(16, "4") == 4
    assert worker_threads(16, "6") == 2
    assert worker_threads(2, "8") == 1  # more workers than cores: one thread each, never 0


def test_outside_xdist_torch_keeps_its_default():
    assert worker_threads(16, None) is None
    assert worker_threads(None, "4") is None
