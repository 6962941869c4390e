import os

import pytest
import torch

# Tests import the package from the checkout; keep CPU runs reproducible and small.
os.environ.setdefault("GEMCTL_THREADS", "2")
# Without a GPU, Triton kernels run under the interpreter (set before any kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Correctness tests run the first kernel config of each list instead of timing every candidate.
os.environ.setdefault("GEMCTL_AUTOTUNE", "0")
# Tests that time candidates (with fakes) keep their picks out of the user's on-disk autotune cache.
os.environ.setdefault("GEMCTL_AUTOTUNE_CACHE", "0")


def worker_threads(cpus: int | None, workers: str | None) -> int | None:
    """CPU threads for one pytest-xdist worker: the machine's cores shared among the workers, so
    that N workers do not each start one OpenMP thread per core. On the 16-core GPU machine, 16
    workers of 16 threads each made a float64 reference that takes a second run for minutes
    (OpenMP threads spinning on oversubscribed cores). None outside xdist."""
    if not workers or not cpus:
        return None
    return max(1, cpus // max(1, int(workers)))


_threads = worker_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                          os.environ.get("PYTEST_XDIST_WORKER_COUNT"))
if _threads:
    torch.set_num_threads(_threads)
    # The trainer sets its threads from GEMCTL_THREADS (in this process and in torchrun ranks):
    # the worker's share, not the fixed 2 above, or the first in-process train() would raise it.
    os.environ["GEMCTL_THREADS"] = str(_threads)
    # and the threads that compile a tuned kernel's candidates (gemctl.ops.triton.common.compile_workers)
    os.environ.setdefault("GEMCTL_COMPILE_WORKERS", str(_threads))


def pytest_collection_modifyitems(config, items):
    # The longest tests (marked slow) first: a parallel run (pytest-xdist deals tests in this order)
    # then starts them at once instead of ending on one worker still compiling or training.
    items.sort(key=lambda item: "slow" not in item.keywords)  # stable: the rest keep their order
    if torch.cuda.is_available():
        gpu_test_timeouts(config, items)
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


GPU_TEST_TIMEOUT_S = 300  # a GPU test's limit (GEMCTL_GPU_TEST_TIMEOUT overrides; 0: none)


def gpu_test_timeouts(config, items):
    """A hung kernel (a TMA or mbarrier protocol that never completes) blocks its process in the
    next synchronizing call forever, and on a shared GPU it slows every other worker's kernels. With
    pytest-timeout installed, each gpu test without a limit of its own gets one, enforced by a
    watchdog thread (a signal cannot interrupt a blocked CUDA call): the stacks are printed and the
    process exits, so xdist reports that test as crashed and goes on with a fresh worker."""
    limit = float(os.environ.get("GEMCTL_GPU_TEST_TIMEOUT", GPU_TEST_TIMEOUT_S))
    if limit <= 0 or not config.pluginmanager.hasplugin("timeout") or config.getoption("timeout", None) is not None:
        return  # off, no plugin, or pytest --timeout given (a marker would override the command line)
    for item in items:
        if "gpu" in item.keywords and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(limit, method="thread"))


def pytest_configure(config):
    if os.environ.get("GEMCTL_TEST_LOG"):  # per-test time and Triton compiles (tests/compile_log.py)
        from compile_log import CompileLog

        log = CompileLog(os.environ["GEMCTL_TEST_LOG"])
        log.install()
        config.pluginmanager.register(log, "gemctl_compile_log")
    import logging

    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
