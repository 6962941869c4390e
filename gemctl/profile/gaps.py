"""What the host was doing while the GPU waited: idle gaps of a profiled step, by host operator.

The breakdown (gemctl/profile/breakdown.py) measures how long the GPU sits idle in a step (host
overhead); this names the cause. From the Chrome trace ``gemctl profile`` writes:

1. the GPU's busy intervals (kernels, copies, memsets of every stream, merged) and the gaps
   between them of at least ``min_gap_us``;
2. for each gap, the kernel that ended it and, by its correlation id, the host call that launched
   it (``cudaLaunchKernel``, ``cuLaunchKernelEx``, ...) on its host thread;
3. the gap's time split over what that thread was running during the gap, the innermost event at
   each instant: an operator (``aten::copy_``), a runtime call (``cudaStreamSynchronize``), a
   profiler range with no operator inside (``gemctl.module.tower.layers.0``: Python in that
   module), or nothing profiled at all (Python between operators).

A gap the host could not have closed sooner (the launch came right after a sync that waited for
the GPU) still shows what ran between the sync's return and the launch: the host time that a
sync exposes.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_HOST_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function")
BETWEEN_OPS = "(Python between operators)"
NO_LAUNCH = "(launch not in the trace)"


def _segments(events: list[tuple[float, float, str]]) -> list[tuple[float, float, str | None]]:
    """A thread's nested events [(start, end, name)] as a flat partition of its time into
    (start, end, innermost name), None where nothing is open. A child that outlives its parent is
    cut at the parent's end."""
    out: list[tuple[float, float, str | None]] = []
    stack: list[tuple[float, str]] = []  # (end, name)
    cursor = None

    def emit(a, b, name):
        if a is not None and b > a:
            out.append((a, b, name))

    for start, end, name in sorted(events, key=lambda e: (e[0], -e[1])):
        while stack and stack[-1][0] <= start:
            top_end, top_name = stack.pop()
            emit(cursor, top_end, top_name)
            cursor = top_end
        if cursor is not None and cursor < start:
            emit(cursor, start, stack[-1][1] if stack else None)
        cursor = start
        stack.append((min(end, stack[-1][0]) if stack else end, name))
    while stack:
        top_end, top_name = stack.pop()
        emit(cursor, top_end, top_name)
        cursor = top_end
    return out


def _label(name: str | None) -> str:
    if name is None or name.startswith("ProfilerStep"):
        return BETWEEN_OPS
    return name


def idle_by_host(trace: dict | list, steps: int, min_gap_us: float = 5.0, top: int = 12) -> dict:
    """GPU idle time a step by what the launching host thread was doing (see the module doc).

    Returns ``{"gap_ms_per_step", "gaps_per_step", "rows": [{"host", "ms_per_step", "share",
    "gaps_per_step"}]}`` (``rows`` most first, ``top`` of them, share of the gap time); empty rows
    when the trace has no GPU activity (a CPU run)."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    kernels = []
    launches: dict[int, tuple] = {}
    host: dict = defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat = e.get("cat", "")
        ts, dur = float(e["ts"]), float(e["dur"])
        if cat in _GPU_CATS:
            kernels.append((ts, ts + dur, (e.get("args") or {}).get("correlation")))
        elif cat in _HOST_CATS:
            key = (e.get("pid"), e.get("tid"))
            host[key].append((ts, ts + dur, e.get("name", "?")))
            if cat in ("cuda_runtime", "cuda_driver"):
                corr = (e.get("args") or {}).get("correlation")
                if corr is not None:
                    launches[corr] = (key, ts)
    steps = max(steps, 1)
    empty = {"gap_ms_per_step": 0.0, "gaps_per_step": 0.0, "rows": []}
    if not kernels:
        return empty
    kernels.sort()
    segments = {key: _segments(evs) for key, evs in host.items()}
    seg_starts = {key: [s[0] for s in segs] for key, segs in segments.items()}
    per: dict[str, list] = defaultdict(lambda: [0.0, 0])  # label -> [us, gaps it was seen in]

    def add(label: str, us: float, seen: set) -> None:
        per[label][0] += us
        if label not in seen:
            seen.add(label)
            per[label][1] += 1

    total, n_gaps = 0.0, 0
    busy_end = kernels[0][1]
    for start, end, corr in kernels[1:]:
        if start - busy_end >= min_gap_us:
            g0, g1 = busy_end, start
            total += g1 - g0
            n_gaps += 1
            launch = launches.get(corr)
            seen: set = set()
            if launch is None:
                add(NO_LAUNCH, g1 - g0, seen)
            else:
                key = launch[0]
                segs, starts = segments[key], seg_starts[key]
                i = max(bisect.bisect_right(starts, g0) - 1, 0)
                covered = 0.0
                while i < len(segs) and segs[i][0] < g1:
                    a, b, name = segs[i]
                    overlap = min(b, g1) - max(a, g0)
                    if overlap > 0:
                        add(_label(name), overlap, seen)
                        covered += overlap
                    i += 1
                if g1 - g0 - covered > 1e-9:  # no profiled event open on the thread: Python
                    add(BETWEEN_OPS, g1 - g0 - covered, seen)
        busy_end = max(busy_end, end)
    if not n_gaps:
        return empty
    ranked = sorted(per.items(), key=lambda kv: -kv[1][0])[:top]
    return {"gap_ms_per_step": total / steps / 1e3, "gaps_per_step": n_gaps / steps,
            "rows": [{"host": name, "ms_per_step": us / steps / 1e3, "share": us / total, "gaps_per_step": n / steps}
                     for name, (us, n) in ranked]}
