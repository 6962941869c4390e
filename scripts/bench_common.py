"""Pieces shared by the kernel benchmarks: the timer, the copy-bandwidth ceiling and the run's
metadata (GPU, versions, date), so every table states the same things the same way."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import torch
import triton
import triton.testing


def bench(fn, grad_to_none=None, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` over ~``rep`` ms of repeats (launch overhead included)."""
    return triton.testing.do_bench(fn, warmup=25, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def graph_bench(fn, rep: int = 100, nan_on_failure: bool = False) -> float:
    """Median milliseconds of ``fn`` by CUDA-graph replay: GPU time without the host launch cost
    (which bounds eager calls of short kernels). Where ``fn`` cannot be captured: raises, or with
    ``nan_on_failure`` says so and returns NaN (callers that keep their eager timing then)."""
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    except Exception as exc:  # noqa: BLE001
        if not nan_on_failure:
            raise
        torch.cuda.synchronize()
        print(f"  (CUDA graph capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]})", flush=True)
        return float("nan")


def profile_step(fn, warmup: int = 3) -> None:
    """For ``ncu --profile-from-start off``: ``fn`` ``warmup`` times (compilation, autotuning, plans),
    then once between CUDA profiler start and stop, so the counters cover one step only."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def copy_tbps() -> float:
    """Device copy bandwidth (TB/s, read + write) of a 1 GiB bf16 tensor: the memory ceiling."""
    x = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return 2 * x.numel() * 2 / (bench(lambda: y.copy_(x)) * 1e-3) / 1e12


def source_commit() -> str:
    """The commit the numbers belong to: $GEMCTL_COMMIT when set (a copy of the tree whose git
    metadata is stale or absent, e.g. on a lent GPU machine), else ``git rev-parse --short HEAD``
    with "-dirty" when tracked files differ from it, else "unknown"."""
    if os.environ.get("GEMCTL_COMMIT"):
        return os.environ["GEMCTL_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                               cwd=root).stdout
    except OSError:
        return "unknown"
    return (head.strip() + ("-dirty" if dirty.strip() else "")) if head.strip() else "unknown"


def base_meta(**extra) -> dict:
    """Date, GPU, torch and triton versions, the commit, and ``extra``: what every result file records."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"
    return {"date": time.strftime("%Y-%m-%d"), "gpu": gpu, "torch": torch.__version__,
            "triton": triton.__version__, "commit": source_commit(), **extra}


def run_meta(**extra) -> dict:
    """base_meta, and the copy ceiling measured now."""
    meta = {**base_meta(**extra), "copy_tbps": copy_tbps()}
    print(meta, flush=True)
    return meta
