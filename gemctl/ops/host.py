"""Host copies of device offsets, so kernels can plan their grids without a device sync.

A jagged batch carries its offsets twice: on the device (for the kernels) and on the host (for
planning). ``register(device_offsets, host_offsets)`` links the two; ``host_of(device_offsets)``
returns the host copy, falling back to a copy from the device (a sync) with a one-time notice when
nobody registered it. Derived plans (tile work lists) are cached on the entry, so the layers of a
step and its backward share one plan.
"""

from __future__ import annotations

import sys
import weakref

import torch

# id(device offsets) -> entry; an entry is dropped when its tensor is collected (tensors define
# elementwise ==, so a WeakKeyDictionary cannot hold them).
_entries: dict[int, "_Entry"] = {}
_warned = False


def _put(tensor: torch.Tensor, entry: "_Entry") -> "_Entry":
    key = id(tensor)
    if key not in _entries:
        weakref.finalize(tensor, _entries.pop, key, None)
    _entries[key] = entry
    return entry


class _Entry:
    __slots__ = ("host", "plans")

    def __init__(self, host: torch.Tensor):
        self.host = host
        self.plans: dict = {}


def register(device_offsets: torch.Tensor, host_offsets: torch.Tensor) -> torch.Tensor:
    """Remember ``host_offsets`` (int64, CPU) as the host copy of ``device_offsets``."""
    if device_offsets.device.type != "cpu":
        _put(device_offsets, _Entry(host_offsets))
    return device_offsets


def _entry(offsets: torch.Tensor) -> _Entry:
    global _warned
    entry = _entries.get(id(offsets))
    if offsets.device.type == "cpu":
        return entry if entry is not None else _put(offsets, _Entry(offsets))
    if entry is None:
        if not _warned:
            _warned = True
            print(
                "gemctl.ops: offsets without a registered host copy; copying them from the device "
                "(a sync per step). Register them with gemctl.ops.host.register.",
                file=sys.stderr,
            )
        entry = _put(offsets, _Entry(offsets.cpu()))
    return entry


def host_of(offsets: torch.Tensor) -> torch.Tensor:
    return _entry(offsets).host


def cached_plan(offsets: torch.Tensor, key, build):
    """``build()`` once per (offsets tensor, key); later calls return the cached result."""
    plans = _entry(offsets).plans
    if key not in plans:
        plans[key] = build()
    return plans[key]
