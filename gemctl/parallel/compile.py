"""torch.compile of the sequence tower's layers (``parallel.compile``), step 3 of parallelize.

Regional compilation, as torchtitan compiles each transformer block: every ``SequenceLayer`` is
compiled in place (``nn.Module.compile``), so FSDP2 then wraps the same module objects and the
compiler sees one layer at a time (identical layers share a graph; compile time does not grow with
depth). The jagged-attention, block-attention and GDPA kernels enter the graph as torch.library
custom ops with fake implementations (gemctl.ops), so they do not break it; what Inductor gains
is the rest of the layer: RMSNorm, residual adds, SiLU and the casts around the GEMMs fused into
fewer kernels, and fewer launches from Python (the step's GPU idle time).

Token counts and the longest history change from batch to batch: the first batches compile the
layer for static shapes, then once more with those sizes symbolic (PyTorch's automatic dynamic
shapes); after that a new batch reuses the graph. Compile time is one-off work: it is timed by
torch's compile callbacks and, like Triton autotuning, left out of the step times of the window
it falls in (``compile_seconds``; gemctl.train.trainer.kernel_setup_seconds).
"""

from __future__ import annotations

import os
import time

# GEMCTL_COMPILE_BACKEND=aot_eager traces the same graphs without generating code (the CPU tests:
# no C++ compiler needed, the same ATen ops as eager).
BACKEND = os.environ.get("GEMCTL_COMPILE_BACKEND", "inductor")

_seconds = 0.0  # wall seconds inside torch.compile (forward and lazy backward compiles)
_started: tuple[float, float] | None = None
_installed = False


def _triton_seconds() -> float:
    try:
        from gemctl.ops.triton.common import setup_seconds
    except ImportError:
        return 0.0
    return setup_seconds()


def _on_start(_args) -> None:
    global _started
    _started = (time.perf_counter(), _triton_seconds())


def _on_end(_args) -> None:
    """Adds the compile's wall time, less Triton work of ours counted during it (no double count)."""
    global _seconds, _started
    if _started is not None:
        t0, triton0 = _started
        _seconds += max(0.0, time.perf_counter() - t0 - (_triton_seconds() - triton0))
        _started = None


def _install_timer() -> None:
    global _installed
    if _installed:
        return
    from torch._dynamo.callback import callback_handler

    callback_handler.register_start_callback(_on_start)  # outermost compile only (nested ones count once)
    callback_handler.register_end_callback(_on_end)
    _installed = True


def compile_seconds() -> float:
    """Wall seconds torch.compile has spent compiling so far in this process (0 when unused)."""
    return _seconds


def apply_compile(model, backend: str | None = None) -> int:
    """Compile every layer of ``model.tower`` in place; returns how many."""
    _install_timer()
    layers = list(model.tower.layers)
    for layer in layers:
        layer.compile(backend=backend or BACKEND)
    return len(layers)
