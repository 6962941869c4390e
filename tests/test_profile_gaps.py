"""GPU idle gaps by host activity (gemctl/profile/gaps.py), on hand-built Chrome traces."""

import pytest

from gemctl.profile.gaps import BETWEEN_OPS, NO_LAUNCH, _segments, idle_by_host


def _x(cat, name, ts, dur, tid=1, pid=1, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def test_segments_take_the_innermost_event():
    segs = _segments([(0, 100, "step"), (10, 50, "op"), (20, 30, "launch"), (60, 120, "outlives")])
    assert segs == [(0, 10, "step"), (10, 20, "op"), (20, 30, "launch"), (30, 50, "op"), (50, 60, "step"),
                    (60, 100, "outlives")]


def test_a_gap_is_split_over_what_the_launching_thread_ran():
    """Kernel 1 ends at 100, kernel 2 starts at 200: 100 us idle. Its launch (correlation 2) came
    from thread 1, which during the gap ran aten::copy_ (100-160), then Python with no operator
    open (160-180) inside the step range, then the launch call (180-190), then nothing (190-200)."""
    trace = {"traceEvents": [
        _x("kernel", "k1", 0, 100, pid=0, tid=7, corr=1),
        _x("kernel", "k2", 200, 50, pid=0, tid=7, corr=2),
        _x("user_annotation", "ProfilerStep#0", -10, 190),
        _x("cpu_op", "aten::copy_", 90, 70),
        _x("cuda_runtime", "cudaLaunchKernel", -5, 2, corr=1),
        _x("cuda_runtime", "cudaLaunchKernel", 180, 10, corr=2),
        _x("cpu_op", "aten::mul", 150, 100, tid=2),  # another thread: not the launcher
    ]}
    out = idle_by_host(trace, steps=1)
    rows = {r["host"]: r["ms_per_step"] * 1e3 for r in out["rows"]}
    assert out["gap_ms_per_step"] == pytest.approx(0.1) and out["gaps_per_step"] == 1
    assert rows == pytest.approx({"aten::copy_": 60, BETWEEN_OPS: 30, "cudaLaunchKernel": 10})
    assert sum(r["share"] for r in out["rows"]) == pytest.approx(1.0)


def test_overlapping_streams_and_short_gaps_are_not_idle():
    trace = [
        _x("kernel", "a", 0, 100, pid=0, tid=7, corr=1),
        _x("kernel", "b", 50, 100, pid=0, tid=8, corr=2),  # another stream: busy until 150
        _x("kernel", "c", 152, 10, pid=0, tid=7, corr=3),  # 2 us after: below min_gap_us
        _x("gpu_memcpy", "Memcpy HtoD", 200, 10, pid=0, tid=7, corr=4),  # 38 us gap, launch missing
    ]
    out = idle_by_host(trace, steps=2, min_gap_us=5.0)
    assert out["gaps_per_step"] == 0.5 and out["gap_ms_per_step"] == pytest.approx(0.038 / 2)
    assert [r["host"] for r in out["rows"]] == [NO_LAUNCH]


def test_cpu_traces_have_no_gaps():
    assert idle_by_host({"traceEvents": [_x("cpu_op", "aten::mm", 0, 10)]}, steps=1)["rows"] == []


def test_profile_prints_the_idle_and_kernel_tables():
    from rich.console import Console

    from gemctl.cli import idle_table, kernels_table

    report = {"device_type": "cuda",
              "top_kernels": [{"name": "_fp8_gemm_tma_kernel", "calls_per_step": 48, "ms_per_step": 15.6, "share": 0.23}],
              "idle_by_host": {"gap_ms_per_step": 29.0, "gaps_per_step": 310,
                               "rows": [{"host": "aten::copy_", "ms_per_step": 12.0, "share": 0.41, "gaps_per_step": 20}]}}
    console = Console(record=True, width=160)
    console.print(kernels_table(report))
    console.print(idle_table(report))
    text = console.export_text()
    assert "_fp8_gemm_tma_kernel" in text and "15.60" in text and "top 1 kernels by device time" in text
    assert "GPU idle 29.00 ms a step in 310 gaps" in text and "aten::copy_" in text and "12.00" in text
