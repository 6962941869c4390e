"""Benchmark gemctl's Triton GDPA on pma-32, cross-32, cross-128 and self-1000 against padded
bmm -> GELU -> bmm in PyTorch (eager and torch.compile), the PyTorch jagged reference and the
softmax jagged attention at the same shape, with the roofline of each workload, in one process.

    python scripts/bench_gdpa.py [--out bench_gdpa.json] [--grids]

Useful FLOPs: 4*H*D per (query, key) pair (two GEMMs); backward 2.5x (dV, dS and dQ/dK GEMMs plus
the recomputed Q K^T), as for softmax attention. Bytes: q, k, v read once and the output written
once (bf16) - the least any implementation moves. Roofline = min(measured bf16 GEMM rate, measured
copy bandwidth x FLOPs / bytes), both ceilings measured in the same run.

Two timings per implementation, both medians of triton.testing: "call" (do_bench: what a Python
caller sees, launch overhead included) and "graph" (do_bench_cudagraph: the same call replayed
from a CUDA graph, i.e. GPU time). The roofline share uses graph time. --grids also times the
forward under every candidate config (tiles, warps, stages, persistent or not). --probes adds, for
each Gluon config among --grid-configs, its two timing probes (gdpa_hopper PROBE: the memory
pipeline without the math, the math without HBM traffic for q and the output), which say how far
apart the two are and so what an overlap of them could gain.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (  # noqa: E402
    add_configs_argument, add_pin_argument, base_meta, graph_bench, parse_configs, parse_pins, picked_configs,
    profile_step,
)
from bench_jagged_attention import bench, make_inputs, tflops  # noqa: E402
from gemctl import ops  # noqa: E402
from gemctl.metrics.flops import attention, attention_pairs  # noqa: E402
from gemctl.ops.triton import common  # noqa: E402
from gemctl.ops.triton import gdpa as gdpa_kernels  # noqa: E402
from workloads import cross_workload, pma_workload, self_workload  # noqa: E402


def ceilings() -> dict:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm_ms = bench(lambda: a @ b)
    x = torch.randn(2**30 // 2, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    copy_ms = bench(lambda: y.copy_(x))
    return {"gemm_tflops": 2 * 8192**3 / (gemm_ms * 1e-3) / 1e12, "copy_tbps": 2 * x.numel() * 2 / (copy_ms * 1e-3) / 1e12}


def timings(fwd, fwd_bwd) -> dict:
    """fwd and fwd+bwd, call and graph time (ms); a graph failure is recorded, not fatal."""
    fwd(), fwd_bwd()  # compile, tune, build plans
    torch.cuda.synchronize()
    out = {"fwd_call_ms": bench(fwd), "fwd_bwd_call_ms": bench(fwd_bwd)}
    for name, fn in (("fwd_graph_ms", fwd), ("fwd_bwd_graph_ms", fwd_bwd)):
        try:
            out[name] = graph_bench(fn)
        except Exception as exc:  # e.g. an op that syncs cannot be captured
            out[name.replace("_ms", "_error")] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            torch.cuda.synchronize()
    return out


def jagged_impl(w, op):
    q, k, v, qo, ko, _, _, grad = make_inputs(w)
    mq, mk = int(w.q_lengths.max()), int(w.k_lengths.max())

    def fwd():
        return op(q, k, v, qo, ko, mq, mk)

    def fwd_bwd():
        torch.autograd.backward(fwd(), grad)

    return fwd, fwd_bwd


def padded_impl(w, compiled: bool):
    b, h, d = w.batch, w.heads, w.head_dim
    mq, mk = int(w.q_lengths.max()), int(w.k_lengths.max())
    gen = torch.Generator().manual_seed(0)

    def rnd(n):
        return torch.randn(b, h, n, d, generator=gen).to("cuda", torch.bfloat16).requires_grad_(True)

    q, k, v = rnd(mq), rnd(mk), rnd(mk)
    g = torch.randn(b, h, mq, d, generator=gen).to("cuda", torch.bfloat16)
    kmask = (torch.arange(mk)[None, :] < w.k_lengths[:, None]).to("cuda", torch.bfloat16)[:, None, None, :]
    scale = d**-0.5

    def f(q, k, v):
        return torch.matmul(F.gelu(torch.matmul(q, k.transpose(-1, -2)) * scale) * kmask, v)

    fn = torch.compile(f) if compiled else f
    return (lambda: fn(q, k, v)), (lambda: fn(q, k, v).backward(g))


def implementations(w) -> dict:
    def ours(q, k, v, qo, ko, mq, mk):
        return ops.gdpa(q, k, v, qo, ko, mq, mk, activation="gelu", backend="triton")

    def reference(q, k, v, qo, ko, mq, mk):
        return ops.gdpa(q, k, v, qo, ko, mq, mk, activation="gelu", backend="torch")

    def softmax(q, k, v, qo, ko, mq, mk):
        return ops.jagged_attention(q, k, v, qo, ko, mq, mk, backend="triton")

    return {
        "ours": lambda: jagged_impl(w, ours),
        "jagged_reference": lambda: jagged_impl(w, reference),
        "padded_eager": lambda: padded_impl(w, False),
        "padded_compiled": lambda: padded_impl(w, True),
        "softmax_jagged": lambda: jagged_impl(w, softmax),
    }


def ab_forward(w, rounds: int) -> dict:
    """Our forward and the softmax jagged attention forward (both autotuned already), CUDA-graph time
    in alternating rounds: a comparison that the drift of one long run cannot favour either side in
    (the two differ by less than the spread between runs at self-1000)."""
    impls = implementations(w)
    ours, softmax = impls["ours"]()[0], impls["softmax_jagged"]()[0]
    ours_ms, softmax_ms = [], []
    for _ in range(rounds):
        ours_ms.append(graph_bench(ours))
        softmax_ms.append(graph_bench(softmax))
    ratios = sorted(s / o for o, s in zip(ours_ms, softmax_ms))
    return {"ours_ms": ours_ms, "softmax_ms": softmax_ms, "ours_median_ms": statistics.median(ours_ms),
            "softmax_median_ms": statistics.median(softmax_ms), "ratio_min": ratios[0], "ratio_max": ratios[-1],
            "ratio_median": statistics.median(ratios), "ours_faster": f"{sum(r > 1 for r in ratios)} of {rounds}"}


PROBE_NAMES = {1: "memory alone", 2: "math alone"}  # gdpa_hopper's PROBE field (the configs' eleventh)


def with_probes(configs: list[tuple]) -> list[tuple]:
    """configs, each resident Gluon one (ninth field 1, or 2: the warp-specialized resident form)
    followed by its probes (eleventh field 1 and 2), with the probes let through gdpa_hopper.forward."""
    from gemctl.ops.triton import gdpa_hopper

    gdpa_hopper.PROBES = True
    out = []
    for cfg in configs:
        out.append(cfg)
        # the resident Gluon kernels' (the streaming one has none); a probe is not probed again
        if common.config_field(cfg, 8) in (1, 2) and not common.config_field(cfg, 10):
            fields = (tuple(cfg) + (0,) * 11)[:max(len(cfg), 11)]  # the probe at index 10, later fields kept
            out += [fields[:10] + (probe,) + fields[11:] for probe in (1, 2)]
    return out


def grid_sweep(w, configs=None) -> list[dict]:
    """Forward graph time under every candidate config (persistent and one-program-per-item), or
    under ``configs`` (tuples) only."""
    fwd, _ = jagged_impl(w, lambda *a: ops.gdpa(*a, activation="gelu", backend="triton"))
    rows = []
    for cfg in configs or gdpa_kernels._FWD_CANDIDATES:
        with common.forced_config(cfg):
            try:
                fwd()
                rows.append({"config": list(cfg), "fwd_graph_ms": graph_bench(fwd)})
            except Exception as exc:
                rows.append({"config": list(cfg), "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"})
            print(f"  {w.name} forward {str(tuple(cfg)):26s} {rows[-1].get('fwd_graph_ms', float('nan')):.4f} ms "
                  f"{rows[-1].get('error', '')[:60]}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_gdpa.json")
    ap.add_argument("--grids", action="store_true", help="also time the forward under every candidate config")
    ap.add_argument("--grid-only", action="store_true",
                    help="time the forward configs (--grid-configs, default all) and the softmax jagged forward, nothing else")
    add_configs_argument(ap, "--grid-configs", "with --grids or --grid-only: these forward configs only (comma-separated "
                         "fields, e.g. 64,32,4,2,0,0,0,128; separate arguments or one quoted list)")
    ap.add_argument("--only", nargs="*", help="workload names to run (default: all)")
    ap.add_argument("--profile-step", metavar="WORKLOAD",
                    help="one GDPA forward+backward of WORKLOAD between profiler start and stop (ncu), nothing else")
    ap.add_argument("--ab", type=int, default=0, metavar="N",
                    help="also time our forward and the softmax jagged forward in N alternating rounds (CUDA graphs)")
    ap.add_argument("--probes", action="store_true",
                    help="with --grid-only: also time each Gluon config's probes (memory alone, math alone; wrong outputs); "
                    "with --profile-step: let a pinned probe config run (ncu of a probe)")
    ap.add_argument("--pending", action="store_true",
                    help="autotune the forward configs the GPU tier has not passed yet too (gdpa._GPU_CHECKED): "
                    "the benchmark of a new kernel before its configs join autotuning")
    add_pin_argument(ap)
    args = ap.parse_args()
    gdpa_kernels._PENDING_AUTOTUNE = args.pending
    grid_configs = parse_configs("--grid-configs", args.grid_configs)
    pins = parse_pins(args.pin, bool(args.profile_step))
    if args.probes and not ((args.grid_only and grid_configs) or args.profile_step):
        ap.error("--probes: give it with --grid-only and --grid-configs (the Gluon configs to probe), or with "
                 "--profile-step and a pinned probe config")
    if not torch.cuda.is_available():
        print("bench_gdpa: needs a CUDA GPU (the CPU tier is tests/test_gdpa_triton.py)", file=sys.stderr)
        raise SystemExit(2)
    if args.probes and args.profile_step:
        from gemctl.ops.triton import gdpa_hopper

        gdpa_hopper.PROBES = True  # the pinned config may be a probe
    elif args.probes:
        grid_configs = with_probes(grid_configs)
    workloads = [pma_workload(256, 32), cross_workload(256, 32), cross_workload(256, 128), self_workload(256, 1000)]
    if args.profile_step:
        by_name = {w.name: w for w in workloads}
        if args.profile_step not in by_name:
            raise SystemExit(f"bench_gdpa: --profile-step takes one of {sorted(by_name)}, got {args.profile_step!r}")
        profile_step(implementations(by_name[args.profile_step])["ours"]()[1], pins=pins)  # forward+backward
        return
    meta = {**base_meta(), **ceilings(), "pending_autotune": args.pending}
    print(meta, flush=True)
    rows = []
    for w in [w for w in workloads if not args.only or w.name in args.only]:
        pairs = attention_pairs(w.q_lengths, w.k_lengths, causal=False)
        f_flops = attention(w.heads, w.head_dim, pairs)
        bytes_moved = 2 * w.heads * w.head_dim * (2 * int(w.q_lengths.sum()) + 2 * int(w.k_lengths.sum()))
        intensity = f_flops / bytes_moved
        roof = min(meta["gemm_tflops"], meta["copy_tbps"] * intensity)
        row = {"workload": w.name, "pairs": pairs, "fwd_flops": f_flops, "bytes": bytes_moved,
               "intensity_flop_per_byte": intensity, "roofline_tflops": roof}
        if args.grid_only:  # the forward configs alone, against this run's roofline and softmax forward
            row["grid_sweep"] = grid_sweep(w, grid_configs)
            softmax_fwd, _ = implementations(w)["softmax_jagged"]()
            softmax_fwd()  # autotuned before it is timed
            row["softmax_jagged_fwd_graph_ms"] = graph_bench(softmax_fwd)
            print(f"  {w.name} softmax jagged attention forward (autotuned) {row['softmax_jagged_fwd_graph_ms']:.4f} ms",
                  flush=True)
            for r in row["grid_sweep"]:
                if "fwd_graph_ms" in r:
                    r["fwd_graph_tflops"] = tflops(f_flops, r["fwd_graph_ms"])
                    probe = PROBE_NAMES.get(common.config_field(r["config"], 10)) if common.config_field(r["config"], 8) else None
                    if probe:  # not a result: the share of the roofline a part of the kernel alone would reach
                        r["probe"] = probe
                    print(f"  {w.name} forward {str(tuple(r['config'])):26s} {r['fwd_graph_tflops']:.0f} TF/s = "
                          f"{100 * r['fwd_graph_tflops'] / roof:.1f}% of {roof:.0f} TF/s"
                          + (f" (probe: {probe}, wrong outputs by design)" if probe else ""), flush=True)
            rows.append(row)
            continue
        for name, make in implementations(w).items():
            try:
                r = timings(*make())
                for kind in ("call", "graph"):
                    if f"fwd_{kind}_ms" in r:
                        r[f"fwd_{kind}_tflops"] = tflops(f_flops, r[f"fwd_{kind}_ms"])
                    if f"fwd_bwd_{kind}_ms" in r:
                        r[f"fwd_bwd_{kind}_tflops"] = tflops(3.5 * f_flops, r[f"fwd_bwd_{kind}_ms"])
                row[name] = r
            except Exception as exc:
                row[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            torch.cuda.empty_cache()
        row["configs"] = picked_configs(("gdpa_fwd", "gdpa_dkdv", "gdpa_dq"))  # this workload's and earlier ones
        if args.grids:
            row["grid_sweep"] = grid_sweep(w, grid_configs)
        if args.ab:
            row["ab_softmax"] = ab_forward(w, args.ab)
        rows.append(row)
        ours = row["ours"]
        lines = [f"{w.name}: intensity {intensity:.1f} FLOP/B, roofline {roof:.0f} TF/s"]
        for name in implementations(w):
            r = row[name]
            if "error" in r:
                lines.append(f"  {name:>17}: {r['error'][:100]}")
                continue
            g = (f"graph fwd {r['fwd_graph_ms']:.3f} ms ({r['fwd_graph_tflops']:.0f} TF/s)" if "fwd_graph_ms" in r
                 else f"graph: {r.get('fwd_graph_error', '')[:60]}")
            lines.append(f"  {name:>17}: call fwd {r['fwd_call_ms']:.3f} ms ({r['fwd_call_tflops']:.0f} TF/s), "
                         f"fwd+bwd {r['fwd_bwd_call_ms']:.3f} ms | {g}")
        if "fwd_graph_tflops" in ours:
            lines.append(f"  ours forward: {100 * ours['fwd_graph_tflops'] / roof:.0f}% of the roofline (graph time)")
        if args.ab:
            ab = row["ab_softmax"]
            lines.append(f"  forward, {args.ab} alternating rounds: ours {ab['ours_median_ms']:.4f} ms, softmax jagged "
                         f"{ab['softmax_median_ms']:.4f} ms; softmax / ours per round {ab['ratio_min']:.3f} .. "
                         f"{ab['ratio_max']:.3f} (median {ab['ratio_median']:.3f}, ours faster in {ab['ours_faster']})")
        print("\n".join(lines), flush=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
