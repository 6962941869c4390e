"""Named profiler ranges that cost nothing outside a profile.

``gemctl profile`` sorts device time into categories by the ranges a kernel runs under
(gemctl/profile/breakdown.py: ``gemctl.attention.*``, ``gemctl.gemm.*``, ``gemctl.embedding``);
opening a ``torch.profiler.record_function`` range costs ~2-3 us of host time per call whether or
not a profiler runs, so the per-call sites open one only while a profiler does.
"""

from __future__ import annotations

import contextlib

import torch


def profiled(name: str):
    """A profiler range named ``name`` while a profiler runs, nothing otherwise. Under
    torch.compile always the range (the traced graph keeps it, as before; asking whether a profiler
    runs would break the graph)."""
    if torch.compiler.is_compiling() or torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
