"""What a result belongs to: the code (commit), the library versions and the date. Every run's
summary.json carries it, and so do the benchmarks' result files, so a number can be traced back
to the tree and stack that produced it, and `gemctl compare` can say when it merges runs of
different code (deterministic runs repeat only on the same kernels and default configs)."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]  # the checkout, when gemctl runs from one


def source_commit() -> str:
    """$GEMCTL_COMMIT when set (a copy of the tree whose git metadata is stale or absent, e.g. on a
    machine the tree was copied to), else ``git rev-parse --short HEAD`` of the checkout gemctl
    runs from, with "-dirty" when tracked files differ from it, else "unknown" (an installed
    wheel, no git)."""
    if os.environ.get("GEMCTL_COMMIT"):
        return os.environ["GEMCTL_COMMIT"]
    if not (_ROOT / ".git").exists():
        return "unknown"
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=_ROOT,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=_ROOT, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("-dirty" if dirty else "")) if head else "unknown"


def provenance() -> dict:
    """Date (UTC), commit, gemctl, torch, Triton (None if absent) and Python versions."""
    import torch

    import gemctl

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": source_commit(),
            "gemctl": gemctl.__version__, "torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version()}
