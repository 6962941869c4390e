"""A pytest plugin for the GPU tier: one line per test as it finishes, with its wall time and the
Triton JIT compiles it triggered (count, seconds, kernel names), appended to
``$GEMCTL_TEST_LOG/tests_<worker>.tsv``. Lines are flushed as tests finish, so a tier cut by a time
limit still says where its time went (compiles, or the tests' own work). conftest.py registers it
when GEMCTL_TEST_LOG names a directory:

    GEMCTL_TEST_LOG=/tmp/tier python3 -m pytest -q -m gpu -n 16
    sort -t$'\\t' -k3 -n -r /tmp/tier/*.tsv | head     # the slowest tests

Columns: node id, outcome (of the call, or of a setup that failed), wall seconds, compiles,
compile seconds, kernels compiled. A "compile" is a kernel variant this process had not built
yet: it includes variants Triton then finds in its on-disk cache (quick ones).
"""

from __future__ import annotations

import os
import time
from pathlib import Path


class CompileLog:
    def __init__(self, directory: str | os.PathLike):
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"tests_{worker}.tsv"
        self._file = None
        self._reset()

    def _reset(self):
        self.start, self.compiles, self.compile_s, self.kernels, self._t0 = None, 0, 0.0, set(), None

    # Triton's JIT hooks: called before and after each compile of this process.
    def before_compile(self, **kwargs):
        self._t0 = time.perf_counter()
        return None  # None: Triton compiles as usual

    def after_compile(self, **kwargs):
        if self._t0 is not None:
            self.compile_s += time.perf_counter() - self._t0
            self._t0 = None
        self.compiles += 1
        self.kernels.add(kwargs["fn"].name)

    def install(self) -> bool:
        """Chain onto Triton's JIT hooks; hooks installed before (gemctl.ops.triton.common's, if
        imported first) keep running after ours."""
        try:
            from triton import knobs
        except ImportError:  # Triton without knobs (older than 3.4): times only
            return False
        runtime = knobs.runtime
        before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

        def started(*args, **kwargs):
            self.before_compile(**kwargs)
            return before(*args, **kwargs) if before is not None else None

        def finished(*args, **kwargs):
            self.after_compile(**kwargs)
            return after(*args, **kwargs) if after is not None else None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = started, finished
        return True

    def pytest_unconfigure(self, config):
        if self._file is not None:
            self._file.close()
            self._file = None

    def pytest_runtest_setup(self, item):
        self._reset()
        self.start = time.perf_counter()

    def pytest_runtest_logreport(self, report):
        if self.start is None:  # the xdist controller sees the workers' reports: they write their own
            return
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            if self._file is None:
                self._file = open(self.path, "a", buffering=1)
            wall = time.perf_counter() - self.start
            self._file.write(f"{report.nodeid}\t{report.outcome}\t{wall:.2f}\t{self.compiles}\t"
                             f"{self.compile_s:.2f}\t{','.join(sorted(self.kernels))}\n")
