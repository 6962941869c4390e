"""`gemctl profile`: warm up, time steps, profile steps, and explain where the MFU goes.

    warm-up       profile.warmup_steps training steps (compilation, kernel config selection)
    measure       profile.steps steps without the profiler: step time, data wait, FLOPs
    profile       the same number of steps under torch.profiler -> breakdown by category/module
    report        rich table, profile.json, trace.json (Chrome), breakdown.png, waterfall.png

MFU decomposition (ARCHITECTURE.md), for the average rank:
    Local MFU     = FLOPs / ((step time - data stall - exposed comm - straggler wait) x peak)
    Scaling Ratio = (step time - data stall - exposed comm - straggler wait) / step time
    E2E MFU       = global FLOPs / (ranks x step time x peak) = Local MFU x Scaling Ratio
with FLOPs the mean over ranks and the times the means of every rank's own measurement.
Under torchrun every rank profiles its own steps (trace-rank<r>.json). A rank's communication
time (collectives in its profile) includes waiting for slower ranks: with work = step time -
communication - data stall, a rank's straggler wait is (the slowest rank's work - its own work),
at most its communication time, and the rest of its communication is exposed communication.
A single process has no communication and no stragglers; both are reported as 0.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import torch

from gemctl.data.loader import TrainLoader
from gemctl.metrics import mfu as mfu_lib
from gemctl.metrics.provenance import provenance
from gemctl.metrics.sinks import RunDir
from gemctl.profile.breakdown import CATEGORIES, breakdown, top_kernels
from gemctl.train.trainer import kernel_setup_seconds

# Top-level modules of GemModel timed separately (forward ranges; backward ops are attributed to
# the module of the forward op they differentiate).
_MODULES = ("sparse", "seq_in", "ns_tokens", "cross", "pma", "interaction", "heads")


def _install_module_ranges(model) -> list:
    handles = []
    named = dict(model.named_modules())
    paths = [p for p in _MODULES if p in named]
    paths += [f"tower.layers.{i}" for i in range(len(model.tower.layers))] + ["tower.norm"]
    for path in paths:
        module = named[path]
        label = f"gemctl.module.{path}"

        def pre(mod, args, label=label):
            mod._gemctl_range = torch.profiler.record_function(label)
            mod._gemctl_range.__enter__()

        def post(mod, args, output):
            mod._gemctl_range.__exit__(None, None, None)
            del mod._gemctl_range

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    return handles


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile(trainer, out_root: str | None = None, console=None, run_dir: str | None = None) -> dict:
    cfg = trainer.cfg
    device = trainer.device
    pcfg = cfg.profile
    ctx = trainer.ctx
    if run_dir is not None:  # made by the launcher, shared by every rank
        run = RunDir(Path(run_dir))
    else:
        run = RunDir.create(out_root or cfg.run.output_dir, f"{cfg.run.name}-profile")
    loader = TrainLoader(trainer.source, cfg.data, device)
    handles = _install_module_ranges(trainer.model)
    try:
        for _ in range(pcfg.warmup_steps):
            trainer.train_step(next(loader))
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

        flops = attention_flops = samples = 0
        wait = 0.0
        setup0 = kernel_setup_seconds()
        t0 = time.perf_counter()
        for _ in range(pcfg.steps):
            batch = next(loader)
            wait += loader.last_wait_s
            fc = trainer.batch_flops(batch)
            flops += fc.train_total
            attention_flops += 3 * fc.attention_total
            samples += batch.batch_size
            trainer.train_step(batch)
        _sync(device)
        setup_s = kernel_setup_seconds() - setup0  # autotuning or compiles of a shape the warmup missed
        measured_s = max(time.perf_counter() - t0 - setup_s, 1e-9) / pcfg.steps

        os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # keep the profiler's own log lines quiet
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiled_wait = 0.0
        with torch.profiler.profile(activities=activities) as prof:
            t1 = time.perf_counter()
            for _ in range(pcfg.steps):
                batch = next(loader)
                profiled_wait += loader.last_wait_s
                trainer.train_step(batch)
            _sync(device)
            profiled_s = (time.perf_counter() - t1) / pcfg.steps
    finally:
        loader.close()
        for h in handles:
            h.remove()
    trace_name = f"trace-rank{ctx.rank}.json" if ctx.sharded else "trace.json"
    prof.export_chrome_trace(str(run.path / trace_name))
    events = prof.events()
    bd = breakdown(events, pcfg.steps, device.type)
    kernels = top_kernels(events, pcfg.steps, device.type)
    idle_host = None
    if device.type == "cuda":  # what the host ran while the GPU waited (the trace's own timeline)
        from gemctl.profile.gaps import idle_by_host

        idle_host = idle_by_host(json.loads((run.path / trace_name).read_text()), pcfg.steps)

    peak = trainer.peak
    mine = {"rank": ctx.rank, "step_time_s": measured_s, "data_stall_s": wait / pcfg.steps,
            "communication_s": bd.category_s.get("communication", 0.0), "flops_per_step": flops / pcfg.steps,
            "samples_per_step": samples / pcfg.steps}
    ranks = ctx.gather(mine)
    slowest_work = max(r["step_time_s"] - r["communication_s"] - r["data_stall_s"] for r in ranks)
    for r in ranks:
        work = r["step_time_s"] - r["communication_s"] - r["data_stall_s"]
        r["straggler_wait_s"] = min(max(slowest_work - work, 0.0), r["communication_s"])
        r["exposed_communication_s"] = r["communication_s"] - r["straggler_wait_s"]

    def mean(key):
        return sum(r[key] for r in ranks) / len(ranks)

    works = [r["step_time_s"] - r["communication_s"] - r["data_stall_s"] for r in ranks]
    flops_all = [r["flops_per_step"] for r in ranks]
    skew = {"work_time": max(works) / (sum(works) / len(works)) if sum(works) > 0 else 1.0,
            "flops": max(flops_all) / (sum(flops_all) / len(flops_all)) if sum(flops_all) > 0 else 1.0}

    step_flops = mean("flops_per_step")
    measured_s = mean("step_time_s")
    data_stall, exposed_comm, straggler = mean("data_stall_s"), mean("exposed_communication_s"), mean("straggler_wait_s")
    compute_s = max(measured_s - data_stall - exposed_comm - straggler, 1e-12)
    local = mfu_lib.mfu(step_flops, compute_s, peak)
    scaling = compute_s / measured_s
    e2e = mfu_lib.e2e_mfu(step_flops * len(ranks), len(ranks), measured_s, peak)
    gemm_flops = (flops - attention_flops) / pcfg.steps
    attn_flops = attention_flops / pcfg.steps
    cat = bd.category_s
    idle = bd.idle_s
    profiled_stall = profiled_wait / pcfg.steps
    host_overhead = max(idle - profiled_stall, 0.0)
    if device.type == "cuda":
        peak_mem = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        peak_mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    report = {
        "recipe": cfg.run.name,
        "device": mfu_lib.device_name(device),
        "device_type": device.type,
        "peak": peak.describe(),
        "peak_tflops": peak.tflops,
        "steps": pcfg.steps,
        "step_time_s": measured_s,
        "profiled_step_time_s": profiled_s,
        "ranks": len(ranks),
        "per_rank": ranks,
        "straggler_skew": skew,  # max / mean over ranks: measured work time, and FLOPs from lengths
        "qps": sum(r["samples_per_step"] for r in ranks) / measured_s,
        "model_tflops_per_step": step_flops / 1e12,
        "local_mfu": local,
        "scaling_ratio": scaling,
        "e2e_mfu": e2e,
        "exposed_communication_s": exposed_comm,
        "straggler_wait_s": straggler,
        "data_stall_s": data_stall,
        "setup_s_in_timed_steps": setup_s,
        "host_overhead_s": host_overhead,
        "peak_memory_gib": peak_mem,
        "categories_s": cat,
        "idle_s": idle,
        "accounted_s": bd.accounted_s,
        "profiler_window_s": bd.window_s,
        "achieved_tflops": {
            "gemm": gemm_flops / cat["gemm"] / 1e12 if cat.get("gemm") else 0.0,
            "attention": attn_flops / cat["attention"] / 1e12 if cat.get("attention") else 0.0,
        },
        "flops_by_category": {"gemm": gemm_flops, "attention": attn_flops},
        "modules_s": bd.module_s,
        "top_kernels": kernels,
        "idle_by_host": idle_host,
        "waterfall": _waterfall(cat, idle, gemm_flops, attn_flops, peak.tflops * 1e12),
    }
    report["run_dir"] = str(run.path)
    if not ctx.is_main:  # rank 0 writes the report (its own categories; every rank's times)
        return report
    report["provenance"] = provenance()
    run.write_text("profile.json", json.dumps(report, indent=1))
    from gemctl.profile.plots import plot_breakdown, plot_waterfall

    plot_breakdown(report, run.path / "breakdown.png")
    plot_waterfall(report, run.path / "waterfall.png")
    return report



def _waterfall(cat: dict, idle: float, gemm_flops: float, attn_flops: float, peak: float) -> list[tuple[str, float]]:
    """MFU from the peak down: each step's share of the profiled step time that did no useful work
    at peak rate. Ends at the profiled E2E MFU (FLOPs / (profiled step x peak))."""
    total = sum(cat.values()) + idle
    if total <= 0:
        return []
    stages = [("peak", 1.0)]
    losses = [
        ("GEMM below peak", cat.get("gemm", 0.0) - gemm_flops / peak),
        ("attention below peak", cat.get("attention", 0.0) - attn_flops / peak),
    ]
    losses += [(name, cat.get(name, 0.0)) for name in CATEGORIES if name not in ("gemm", "attention")]
    losses.append(("idle (host, data wait)", idle))
    for name, seconds in losses:
        stages.append((name, -seconds / total))
    stages.append(("E2E MFU", (gemm_flops + attn_flops) / peak / total))
    return stages
