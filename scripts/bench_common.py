"""Pieces shared by the kernel benchmarks: the timer, the copy-bandwidth ceiling and the run's
metadata (GPU, versions, date), so every table states the same things the same way."""

from __future__ import annotations

import time

import torch
import triton
import triton.testing


def bench(fn, grad_to_none=None, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` over ~``rep`` ms of repeats (launch overhead included)."""
    return triton.testing.do_bench(fn, warmup=25, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def copy_tbps() -> float:
    """Device copy bandwidth (TB/s, read + write) of a 1 GiB bf16 tensor: the memory ceiling."""
    x = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return 2 * x.numel() * 2 / (bench(lambda: y.copy_(x)) * 1e-3) / 1e12


def run_meta(**extra) -> dict:
    """Date, GPU, torch and triton versions, the copy ceiling measured now, and ``extra``."""
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, **extra, "copy_tbps": copy_tbps()}
    print(meta, flush=True)
    return meta
