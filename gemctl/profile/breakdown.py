"""Where a training step's time goes: torch.profiler events -> time per category and per module.

Categories: gemm, attention, embedding, norm/elementwise, optimizer, communication, data; plus the
time the executing device sits idle (host overhead: Python, launches, syncs). On a GPU the busy
time is kernel time; on a CPU it is the time inside top-level operators.

How an operator gets its category, first rule that applies:
1. profiler ranges it runs under: ``gemctl.attention.*`` (the gemctl.ops dispatcher),
   ``gemctl.gemm.*`` (operators in it; Triton GEMM kernels: see below), ``gemctl.embedding``
   (the sparse arch), ``gemctl.optimizer``, ``gemctl.data``;
2. a backward operator inherits the category of the forward operator it differentiates
   (autograd records the forward op's sequence number on the backward node);
3. its name: collectives -> communication, matrix products -> gemm, embedding lookups ->
   embedding, everything else -> norm/elementwise.
Each operator's *self* time is counted once, so categories never double count (the test suite
checks that categories + idle add up to the measured step time).

On a GPU an operator's self time is the kernels linked to it, and a Triton kernel is linked to
the innermost *operator* around its launch (a custom op, an autograd node), never to a
``record_function`` range: the profiler links kernels by the correlation ids of operators alone
(H200, torch 2.11: an fp8_gemm kernel inside a ``gemctl.gemm.*`` range and no operator had no
CPU parent; in the model the FP8 GEMMs' kernels landed in norm/elementwise, with the operators
around the FP8 linears). So kernels named in ``GEMM_KERNELS`` count as gemm whichever operator
they are linked to; the operator keeps the rest of its self time.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

CATEGORIES = ("gemm", "attention", "embedding", "norm/elementwise", "optimizer", "communication", "data")
_SCOPES = (
    ("gemctl.attention.", "attention"),
    ("gemctl.gemm.", "gemm"),
    ("gemctl.embedding", "embedding"),
    ("gemctl.optimizer", "optimizer"),
    ("gemctl.data", "data"),
)
_GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "aten::matmul", "aten::linear"}
# record_param_comms: the range ProcessGroupNCCL opens around each collective's launch, so the
# innermost CPU op of an NCCL kernel (the op its device time belongs to); without it an FSDP2 run
# on two H200s reported no communication and ~84 ms more norm/elementwise time a step.
_COMM_MARKERS = ("nccl", "c10d::", "record_param_comms", "all_reduce", "allreduce", "all_gather", "allgather",
                 "reduce_scatter", "all_to_all", "gloo")
_ATTENTION_MARKERS = ("scaled_dot_product", "flash_attention", "efficient_attention", "gemctl::jagged_attention", "gemctl::gdpa", "gemctl::block_attention")
_EMBEDDING_MARKERS = ("aten::embedding", "embedding_bag", "fbgemm::")
_BACKWARD_NODE = "autograd::engine::evaluate_function: "
# Events that are not work of their own: profiler ranges, step markers, autograd nodes (their self
# time is Python and dispatch, counted as idle).
_NOT_OPERATORS = ("gemctl.", "ProfilerStep", _BACKWARD_NODE)
# Our Triton GEMM kernels (gemctl.ops.triton.fp8_gemm), by the prefix of the kernel's name.
GEMM_KERNELS = ("_fp8_gemm_kernel", "_fp8_gemm_tma_kernel")


def _gemm_kernel_us(event) -> float:
    """Device time of the GEMM kernels (GEMM_KERNELS) linked to ``event`` itself."""
    return sum(k.duration for k in getattr(event, "kernels", ()) or () if k.name.startswith(GEMM_KERNELS))


def _by_name(name: str) -> str | None:
    low = name.lower()
    if any(m in low for m in _COMM_MARKERS):
        return "communication"
    if any(m in low for m in _ATTENTION_MARKERS):
        return "attention"
    if name in _GEMM_OPS or name.startswith("MmBackward") or name.startswith("AddmmBackward") or name.startswith("BmmBackward"):
        return "gemm"
    if any(m in low for m in _EMBEDDING_MARKERS) or name.startswith("Embedding"):
        return "embedding"
    return None


def _scope_category(event) -> str | None:
    e = event
    while e is not None:
        for prefix, category in _SCOPES:
            if e.name.startswith(prefix):
                return category
        e = e.cpu_parent
    return None


@dataclass
class Breakdown:
    """Per-step seconds by category and by module, from ``steps`` profiled steps."""

    steps: int
    device: str  # "cuda" | "cpu"
    category_s: dict[str, float] = field(default_factory=dict)
    module_s: dict[str, float] = field(default_factory=dict)
    idle_s: float = 0.0  # executing device idle inside the profiled window (host overhead, syncs)
    window_s: float = 0.0  # profiled window per step, from the profiler's own timestamps

    @property
    def busy_s(self) -> float:
        return sum(self.category_s.values())

    @property
    def accounted_s(self) -> float:
        return self.busy_s + self.idle_s


def _by_forward_op(events, label) -> dict[int, str]:
    """sequence_nr of each forward operator -> ``label(op)`` (first non-None label wins).

    Autograd records the forward op's sequence number on the backward node that differentiates
    it, so this is how backward time finds its category and module.
    """
    out: dict[int, str] = {}
    for e in events:
        seq = getattr(e, "sequence_nr", -1)
        if seq is None or seq < 0 or seq in out or e.name.startswith(_BACKWARD_NODE):
            continue
        value = label(e)
        if value is not None:
            out[seq] = value
    return out


def _category(event, forward: dict[int, str]) -> str:
    scoped = _scope_category(event)
    if scoped is not None and scoped != "data":
        return scoped
    # A backward op: find its autograd node and the forward op it belongs to.
    e = event
    while e is not None:
        if e.name.startswith(_BACKWARD_NODE):
            seq = getattr(e, "sequence_nr", -1)
            if seq in forward:
                return forward[seq]
            named = _by_name(e.name[len(_BACKWARD_NODE):])
            if named is not None:
                return named
            break
        e = e.cpu_parent
    if scoped == "data":
        return "data"
    return _by_name(event.name) or "norm/elementwise"


def _module_scope(event) -> str | None:
    e = event
    while e is not None:
        if e.name.startswith("gemctl.module."):
            return e.name[len("gemctl.module."):]
        e = e.cpu_parent
    return None


def _module_of(event, forward_modules: dict[int, str]) -> str | None:
    """The model module an op belongs to: its module range, or for a backward op the module of
    the forward op it differentiates."""
    module = _module_scope(event)
    if module is not None:
        return module
    e = event
    while e is not None:
        if e.name.startswith(_BACKWARD_NODE):
            return forward_modules.get(getattr(e, "sequence_nr", -1))
        e = e.cpu_parent
    return None


def _root(event):
    while event.cpu_parent is not None:
        event = event.cpu_parent
    return event


def _training_events(events):
    """Events of the training thread and of autograd's backward threads; a background data
    producer thread (its batch generation overlaps the step) is left out."""
    main = {e.thread for e in events if e.name == "gemctl.forward"}
    kept = []
    for e in events:
        root = _root(e)
        if root.thread in main or root.name.startswith(_BACKWARD_NODE) or root.name.startswith("autograd::engine"):
            kept.append(e)
    return kept


def breakdown(events, steps: int, device: str, window_us: float | None = None) -> Breakdown:
    """Build the breakdown from ``prof.events()`` of ``steps`` profiled steps."""
    events = [e for e in events if getattr(e, "device_type", None) is None or str(e.device_type).endswith("CPU")]
    events = _training_events(events)
    forward = _by_forward_op(events, lambda e: _scope_category(e) or _by_name(e.name))
    forward_modules = _by_forward_op(events, _module_scope)
    per_category: dict[str, float] = defaultdict(float)
    per_module: dict[str, float] = defaultdict(float)
    starts, ends = [], []
    for e in events:
        starts.append(e.time_range.start)
        ends.append(e.time_range.end)
        gemm_us = 0.0
        if device == "cuda":
            self_us = e.self_device_time_total
            gemm_us = min(_gemm_kernel_us(e), max(self_us, 0.0))
        elif e.name.startswith(_NOT_OPERATORS):
            self_us = 0.0  # ranges and autograd nodes: their self time is Python/dispatch -> idle
        else:
            self_us = e.self_cpu_time_total
        if self_us <= 0:
            continue
        per_category["gemm"] += gemm_us
        per_category[_category(e, forward)] += self_us - gemm_us
        module = _module_of(e, forward_modules)
        if module is not None:
            per_module[module] += self_us
    window = window_us if window_us is not None else (max(ends) - min(starts) if starts else 0.0)
    busy = sum(per_category.values())
    scale = 1e-6 / max(steps, 1)
    return Breakdown(
        steps=steps,
        device=device,
        category_s={c: per_category.get(c, 0.0) * scale for c in CATEGORIES},
        module_s={m: v * scale for m, v in sorted(per_module.items(), key=lambda kv: -kv[1])},
        idle_s=max(window - busy, 0.0) * scale,
        window_s=window * scale,
    )


def top_kernels(events, steps: int, device: str, n: int = 15) -> list[dict]:
    """The ``n`` kernels (GPU; on a CPU, operators by self time) that take the most time a step:
    ``{"name", "calls_per_step", "ms_per_step", "share"}``, share of all kernel time. Read from
    the device's own events, so a kernel linked to no operator counts too; profiler ranges on the
    device timeline (``gemctl.*``, ProfilerStep) are not kernels."""
    per: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in events:
        on_gpu = str(getattr(e, "device_type", "")).endswith("CUDA")
        if on_gpu != (device == "cuda") or e.name.startswith(_NOT_OPERATORS):
            continue
        us = e.device_time_total if on_gpu else e.self_cpu_time_total
        if us <= 0:
            continue
        row = per[e.name]
        row[0] += 1
        row[1] += us
    total = sum(us for _, us in per.values()) or 1.0
    steps = max(steps, 1)
    ranked = sorted(per.items(), key=lambda kv: -kv[1][1])[:n]
    return [{"name": name, "calls_per_step": calls / steps, "ms_per_step": us / steps / 1e3, "share": us / total}
            for name, (calls, us) in ranked]
