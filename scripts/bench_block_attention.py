"""Benchmark gemctl's Triton block attention (RoPE fused) against the memory roofline, full jagged
attention and rotary applied by separate kernels, on self-1000 and self-4000, in one process.

    python scripts/bench_block_attention.py [--out bench_block_attention.json]

bf16, H=4, D=128 (scripts/workloads.py). Block attention is memory-bound (each K/V element serves
one block of queries), so it is judged by bytes, not FLOPs. With T tokens, E = 2 bytes (bf16):
    forward bytes  = 4*T*H*D*E + 4*T*H      q, k, v read + o written (bf16) + lse written (fp32)
    backward bytes = 7*T*H*D*E + 4*T*H      q, k, v, do read + dq, dk, dv written + lse read
(the softmax backward's row term comes from p and dp inside the kernel, so o is not read; before
that change the count was 8*T*H*D*E with o, and the JSON keeps that figure as bwd_bytes_with_o;
the rope tables' rows come through L2 and are not counted; they are fp16, as a bf16 model layer
builds them (ops.rope_table_dtype), and block 64 is also timed with fp32 tables and without rope,
which says what the rotation costs). Roofline time =
bytes / copy bandwidth, the bandwidth of a 1 GiB device-to-device copy (read + write bytes / time)
measured in the same run; % of roofline = roofline time / kernel time, with kernel time from a
CUDA-graph replay of the bare kernel launcher (triton.testing.do_bench_cudagraph, median).

Sections, all on the same inputs:
  (a) block_attention, block 64 with fused RoPE (also blocks 32 and 128): forward and backward
      time, bytes, % of the roofline;
  (b) full jagged attention (gemctl.ops.jagged_attention, triton, non-causal, no bias, no RoPE)
      forward+backward, and the speedup of block 64 + fused RoPE over it;
  (c) fused RoPE vs gemctl.ops.apply_rope on q and k (eager, and torch.compile'd together with the
      attention call) followed by block attention with rope=None: forward and forward+backward.
      The separate path gets per-token cos/sin rows gathered once per batch (not timed).
Timing protocol of scripts/bench_gdpa.py and shared/design/BENCHMARKS.md: "call" = do_bench
(warmup 25, rep 200, median, what a Python caller sees), "graph" = do_bench_cudagraph (GPU time);
speedups use graph time where both sides have it, call time otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (  # noqa: E402
    add_configs_argument, add_pin_argument, base_meta, graph_bench, parse_configs, parse_pins, picked_configs,
    profile_step,
)
from bench_gdpa import ceilings, timings  # noqa: E402
from bench_jagged_attention import make_inputs  # noqa: E402
from gemctl import ops  # noqa: E402
from gemctl.ops.triton import block_attention as block_kernels  # noqa: E402
from gemctl.ops.triton import common  # noqa: E402
from workloads import block_attention_workloads  # noqa: E402

ROPE_BASE = 10000.0
TABLE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}  # --sweep-tables
BLOCK_SIZES = (64, 32, 128)  # 64 (GEM's) first: sections (b) and (c) use it


def byte_counts(tokens: int, heads: int, dim: int, elem: int = 2) -> dict:
    """Bytes that must move: see the module docstring for the formulas."""
    tensor = tokens * heads * dim * elem
    lse = 4 * tokens * heads
    return {"fwd_bytes": 4 * tensor + lse, "bwd_bytes": 7 * tensor + lse, "bwd_bytes_with_o": 8 * tensor + lse}


def block_counts(lengths, block_size: int) -> dict:
    """The work the kernels do beyond the roofline's bytes: query blocks in all, those that end
    past their sequence (partial: masked stores, rows zeroed in shared memory), and the share of
    the blocks' rows that lie past the sequences (read by the TMA boxes, computed, not stored)."""
    lengths = [int(n) for n in lengths]
    blocks = sum(-(-n // block_size) for n in lengths)
    return {"blocks": blocks, "partial_blocks": sum(1 for n in lengths if n % block_size),
            "rows_past_pct": 100 * (blocks * block_size - sum(lengths)) / max(blocks * block_size, 1)}


def roofline_ms(nbytes: int, copy_tbps: float) -> float:
    """The time the bytes take at the measured copy bandwidth (ms); a kernel's share of the roofline
    is this over its time."""
    return nbytes / (copy_tbps * 1e9)


def kernel_times(q, k, v, off, max_len, block_size, tables, grad) -> dict:
    """Graph time (ms) of the bare forward and backward launchers (no autograd around them)."""
    cos, sin = tables
    scale = q.shape[-1] ** -0.5
    args = (off, max_len, block_size, 0.0, scale)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, lse = block_kernels._forward(qd, kd, vd, cos, sin, *args)  # tunes and builds the plan
    block_kernels._backward(grad, qd, kd, vd, lse, cos, sin, *args)
    torch.cuda.synchronize()
    return {
        "fwd_kernel_ms": graph_bench(lambda: block_kernels._forward(qd, kd, vd, cos, sin, *args)),
        "bwd_kernel_ms": graph_bench(lambda: block_kernels._backward(grad, qd, kd, vd, lse, cos, sin, *args)),
    }


def api_pair(fn, q, k, v, grad):
    """(fwd, fwd+bwd) closures over an attention call; gradients are returned, not accumulated."""

    def fwd():
        return fn(q, k, v)

    def fwd_bwd():
        return torch.autograd.grad(fn(q, k, v), [q, k, v], grad)

    return fwd, fwd_bwd


def best_ms(r: dict, name: str) -> tuple[float, str]:
    return (r[f"{name}_graph_ms"], "graph") if f"{name}_graph_ms" in r else (r[f"{name}_call_ms"], "call")


def speedup(ours: dict, other: dict, name: str) -> float:
    kind = "graph" if f"{name}_graph_ms" in ours and f"{name}_graph_ms" in other else "call"
    return other[f"{name}_{kind}_ms"] / ours[f"{name}_{kind}_ms"]


def run_workload(w, copy_tbps: float) -> dict:
    q, k, v, off, _, _, _, grad = make_inputs(w)
    max_len = int(w.q_lengths.max())
    tokens = q.shape[0]
    # The tables a bf16 model layer builds (fp16: ops.rope_table_dtype); fp32 ones timed too (block 64).
    tables = block_kernels.rope_tables(ROPE_BASE, max_len, w.head_dim, q.device, ops.rope_table_dtype(q.dtype))
    tables32 = block_kernels.rope_tables(ROPE_BASE, max_len, w.head_dim, q.device)
    row = {"workload": w.name, "batch": w.batch, "tokens": tokens, "max_len": max_len, "heads": w.heads,
           "head_dim": w.head_dim, "rope_table_dtype": str(tables[0].dtype)}
    row.update(byte_counts(tokens, w.heads, w.head_dim))

    # (a) block attention with fused RoPE against the roofline.
    row["block"] = {}
    for bs in BLOCK_SIZES:
        r = kernel_times(q, k, v, off, max_len, bs, tables, grad)
        r.update(block_counts(w.q_lengths.tolist(), bs))
        for kind in ("fwd", "bwd"):
            roof_ms = roofline_ms(row[f"{kind}_bytes"], copy_tbps)
            r[f"{kind}_roofline_ms"] = roof_ms
            r[f"{kind}_roofline_pct"] = 100 * roof_ms / r[f"{kind}_kernel_ms"]
            r[f"{kind}_tbps"] = row[f"{kind}_bytes"] / (r[f"{kind}_kernel_ms"] * 1e-3) / 1e12
        # against the earlier count with o read, so runs before and after the change compare
        r["bwd_roofline_pct_with_o"] = 100 * roofline_ms(row["bwd_bytes_with_o"], copy_tbps) / r["bwd_kernel_ms"]
        if bs == 64:  # what the rope costs: the same kernels with fp32 tables and without rope
            fp32 = {"fp32_tables": tables32} if tables32[0].dtype != tables[0].dtype else {}
            for name, tabs in {**fp32, "no_rope": (None, None)}.items():
                rv = kernel_times(q, k, v, off, max_len, bs, tabs, grad)
                r[name] = {f"{kind}_{key}": val for kind in ("fwd", "bwd") for key, val in (
                    ("kernel_ms", rv[f"{kind}_kernel_ms"]),
                    ("roofline_pct", 100 * roofline_ms(row[f"{kind}_bytes"], copy_tbps) / rv[f"{kind}_kernel_ms"]))}

        def fused(q, k, v, bs=bs):
            return ops.block_attention(q, k, v, off, max_len, block_size=bs, rope=tables, backend="triton")

        r.update(timings(*api_pair(fused, q, k, v, grad)))
        row["block"][bs] = r
        torch.cuda.empty_cache()
    fused64 = row["block"][64]

    # (b) full jagged attention on the same inputs.
    def full(q, k, v):
        return ops.jagged_attention(q, k, v, off, off, max_len, max_len, backend="triton")

    row["full"] = timings(*api_pair(full, q, k, v, grad))
    row["speedup_fwd_bwd_vs_full"] = speedup(fused64, row["full"], "fwd_bwd")
    torch.cuda.empty_cache()

    # (c) fused RoPE vs rotary by separate kernels, then block attention without rope.
    positions = torch.arange(tokens, device=q.device) - torch.repeat_interleave(off[:-1], off.diff(), output_size=tokens)
    cos_tok, sin_tok = (t[positions] for t in tables)  # (T, D/2), once per batch

    def separate(q, k, v):
        qr, kr = ops.apply_rope(q, cos_tok, sin_tok), ops.apply_rope(k, cos_tok, sin_tok)
        return ops.block_attention(qr, kr, v, off, max_len, block_size=64, rope=None, backend="triton")

    row["separate_eager"] = timings(*api_pair(separate, q, k, v, grad))
    row["separate_compiled"] = timings(*api_pair(torch.compile(separate, fullgraph=True), q, k, v, grad))
    for name in ("separate_eager", "separate_compiled"):
        row[f"rope_speedup_fwd_vs_{name}"] = speedup(fused64, row[name], "fwd")
        row[f"rope_speedup_fwd_bwd_vs_{name}"] = speedup(fused64, row[name], "fwd_bwd")
    torch.cuda.empty_cache()
    return row


def print_tables(rows: list[dict], meta: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)  # logs are not terminals: keep every column
    console.print(f"{meta['gpu']} | torch {meta['torch']} | triton {meta['triton']} | commit {meta['commit']} | "
                  f"copy {meta['copy_tbps']:.2f} TB/s | bf16 GEMM {meta['gemm_tflops']:.0f} TF/s")
    console.print("bytes: fwd = 4*T*H*D*2 + 4*T*H (q,k,v read, o write, lse write); "
                  "bwd = 7*T*H*D*2 + 4*T*H (q,k,v,do read, dq,dk,dv write, lse read; o not read)")
    t = Table(title="(a) block attention, RoPE fused: kernel graph time vs memory roofline")
    for col in ("workload", "block", "fwd ms", "fwd MB", "fwd TB/s", "fwd % roof", "bwd ms", "bwd MB", "bwd TB/s",
                "bwd % roof", "fwd+bwd call ms"):
        t.add_column(col, justify="right")
    for row in rows:
        for bs, r in row["block"].items():
            t.add_row(row["workload"], str(bs), f"{r['fwd_kernel_ms']:.3f}", f"{row['fwd_bytes'] / 1e6:.0f}",
                      f"{r['fwd_tbps']:.2f}", f"{r['fwd_roofline_pct']:.0f}%", f"{r['bwd_kernel_ms']:.3f}",
                      f"{row['bwd_bytes'] / 1e6:.0f}", f"{r['bwd_tbps']:.2f}", f"{r['bwd_roofline_pct']:.0f}%",
                      f"{r['fwd_bwd_call_ms']:.3f}")
            for name, label in (("fp32_tables", "fp32 tables"), ("no_rope", "no rope")):
                if name in r:
                    rv = r[name]
                    t.add_row("", f"{bs}, {label}", f"{rv['fwd_kernel_ms']:.3f}", "", "",
                              f"{rv['fwd_roofline_pct']:.0f}%", f"{rv['bwd_kernel_ms']:.3f}", "", "",
                              f"{rv['bwd_roofline_pct']:.0f}%", "")
    console.print(t)
    for row in rows:  # what the roofline does not count: partial blocks, rows past the sequences
        console.print(f"{row['workload']}: " + "; ".join(
            f"block {bs}: {r['blocks']} blocks, {r['partial_blocks']} partial "
            f"({100 * r['partial_blocks'] / max(r['blocks'], 1):.1f}%), {r['rows_past_pct']:.1f}% of rows past the sequences"
            for bs, r in row["block"].items()))
    t = Table(title="(b) block 64 + fused RoPE vs full jagged attention (fwd+bwd)")
    for col in ("workload", "block fwd+bwd ms", "full fwd+bwd ms", "speedup", "target"):
        t.add_column(col, justify="right")
    for row in rows:
        ms_block, kind = best_ms(row["block"][64], "fwd_bwd")
        ms_full, _ = best_ms(row["full"], "fwd_bwd")
        target = {"self-1000": ">= 2.5x", "self-4000": ">= 8x"}.get(row["workload"], "")
        t.add_row(row["workload"], f"{ms_block:.3f} ({kind})", f"{ms_full:.3f}", f"{row['speedup_fwd_bwd_vs_full']:.2f}x",
                  target)
    console.print(t)
    t = Table(title="(c) fused RoPE vs apply_rope kernels + block attention (block 64; target >= 1.3x)")
    for col in ("workload", "path", "fwd ms", "fwd+bwd ms", "fused speedup fwd", "fused speedup fwd+bwd"):
        t.add_column(col, justify="right")
    for row in rows:
        ms_f, kind = best_ms(row["block"][64], "fwd")
        ms_fb, _ = best_ms(row["block"][64], "fwd_bwd")
        t.add_row(row["workload"], f"fused, {row['rope_table_dtype'][6:]} tables ({kind})", f"{ms_f:.3f}", f"{ms_fb:.3f}", "", "")
        for name in ("separate_eager", "separate_compiled"):
            t.add_row("", name, f"{best_ms(row[name], 'fwd')[0]:.3f}", f"{best_ms(row[name], 'fwd_bwd')[0]:.3f}",
                      f"{row[f'rope_speedup_fwd_vs_{name}']:.2f}x", f"{row[f'rope_speedup_fwd_bwd_vs_{name}']:.2f}x")
    console.print(t)


def whole_blocks(w, block_size: int = 64):
    """``w`` with every sequence rounded up to a multiple of ``block_size`` (named <name>-whole): no
    partial blocks and no rows past the sequences, so that a sweep of both tells what those cost."""
    rounded = (w.q_lengths + block_size - 1) // block_size * block_size
    return dataclasses.replace(w, name=f"{w.name}-whole", q_lengths=rounded, k_lengths=rounded.clone())


def short_tails_halved(w, block_size: int = 64):
    """``w`` with every other partial last block of at most ``block_size`` / 2 rows dropped (its
    sequence cut down to a multiple of ``block_size``; named <name>-trimmed): as many (block, head)
    items as a kernel pairing those blocks two to a tile would run, for a sweep to time what that
    saving is worth before such a kernel is built."""
    tail = w.q_lengths % block_size
    short = (tail > 0) & (tail <= block_size // 2)
    drop = short & (torch.cumsum(short.long(), 0) % 2 == 0)
    cut = torch.where(drop, w.q_lengths - tail, w.q_lengths)
    return dataclasses.replace(w, name=f"{w.name}-trimmed", q_lengths=cut, k_lengths=cut.clone())


def sweep(names, dims, fwd_cfgs, bwd_cfgs, copy_tbps: float, whole: bool = False, table_dtype=None,
          trimmed: bool = False) -> list[dict]:
    """Kernel graph time and % of the roofline of every forced config (block 64, fused RoPE); with
    ``whole`` each workload is followed by its whole_blocks variant, with ``trimmed`` by its
    short_tails_halved one (``names`` select them with it); the rope tables in ``table_dtype``
    (default: what a bf16 layer builds, ops.rope_table_dtype). Each row records the workload's tokens
    and blocks."""
    rows = []
    variants = [f for f, on in ((whole_blocks, whole), (short_tails_halved, trimmed)) if on]
    for w in [v for w in block_attention_workloads() for v in (w, *(f(w) for f in variants))]:
        if names and w.name.removesuffix("-whole").removesuffix("-trimmed") not in names and w.name not in names:
            continue
        shape = {"tokens": int(w.q_lengths.sum()), "blocks": block_counts(w.q_lengths.tolist(), 64)["blocks"]}
        for dim in dims:
            w_dim = dataclasses.replace(w, head_dim=dim)
            q, k, v, off, _, _, _, grad = make_inputs(w_dim)
            max_len = int(w.q_lengths.max())
            tables = block_kernels.rope_tables(ROPE_BASE, max_len, dim, q.device,
                                               table_dtype or ops.rope_table_dtype(q.dtype))
            counts = byte_counts(q.shape[0], w.heads, dim)
            for kind, cfgs in (("fwd", fwd_cfgs), ("bwd", bwd_cfgs)):
                for cfg in cfgs:
                    forced = {"block_attention_fwd": cfg if kind == "fwd" else fwd_cfgs[0],
                              "block_attention_bwd": cfg if kind == "bwd" else bwd_cfgs[0]}
                    try:
                        with common.forced_config(forced):
                            ms = kernel_times(q, k, v, off, max_len, 64, tables, grad)[f"{kind}_kernel_ms"]
                    except Exception as exc:  # a config that does not build or fit
                        print(f"{w.name} D={dim} {kind} {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                        continue
                    pct = 100 * roofline_ms(counts[f"{kind}_bytes"], copy_tbps) / ms
                    rows.append({"workload": w.name, "dim": dim, "kind": kind, "cfg": list(cfg), "ms": ms, "pct": pct,
                                 "tables": str(tables[0].dtype).removeprefix("torch."), **shape})
                    print(f"{w.name:10s} D={dim:3d} {kind} {str(tuple(cfg)):20s} {ms:.4f} ms {pct:5.1f}% roof", flush=True)
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="only time forced configs (block 64, fused RoPE)")
    ap.add_argument("--dims", default="128", help="head dims of the sweep, e.g. '128,64'")
    add_configs_argument(ap, "--fwd-configs", "forward configs of the sweep, e.g. 4,1,1 8,1,1 (separate arguments or one "
                         "quoted list; default: the candidate list)")
    ap.add_argument("--packed-rope", action="store_true",
                    help="both passes rotate bf16 q and k in packed bf16x2 on sm_90+, not in fp32 (the "
                    "Triton kernels only; a benchmark of the two rotations; off by default, see _PACKED_ROPE)")
    add_configs_argument(ap, "--bwd-configs", "backward configs of the sweep, as --fwd-configs (default: the candidate "
                         "list)")
    ap.add_argument("--whole-blocks", action="store_true",
                    help="--sweep: also each workload with its lengths rounded up to whole 64-row blocks (<name>-whole): "
                         "what partial blocks and the rows past the sequences cost")
    ap.add_argument("--trimmed-tails", action="store_true",
                    help="--sweep: also each workload with every other partial last block of at most 32 rows "
                         "dropped (<name>-trimmed): the item count of a kernel pairing those blocks")
    ap.add_argument("--sweep-tables", choices=sorted(TABLE_DTYPES),
                    help="--sweep: the rope tables' dtype (default: what a bf16 layer builds, fp16)")
    ap.add_argument("--out", default="bench_block_attention.json")
    ap.add_argument("--only", nargs="*", help="workload names to run (default: self-1000 self-4000)")
    ap.add_argument("--profile-step", metavar="WORKLOAD",
                    help="one block-64 RoPE forward+backward of WORKLOAD (autotuned) between profiler start and "
                    "stop (ncu), nothing else; <name>-whole profiles the workload rounded up to whole blocks")
    add_pin_argument(ap)
    args = ap.parse_args()
    # malformed configs are refused before any GPU work
    fwd_configs, bwd_configs = (parse_configs(f, v) for f, v in (("--fwd-configs", args.fwd_configs),
                                                                 ("--bwd-configs", args.bwd_configs)))
    block_kernels._PACKED_ROPE = args.packed_rope
    pins = parse_pins(args.pin, bool(args.profile_step))
    as_is = "the full benchmark times the issue's workloads as they are"
    for flag, given, why in (("--whole-blocks", args.whole_blocks, as_is), ("--trimmed-tails", args.trimmed_tails, as_is),
                             ("--sweep-tables", args.sweep_tables, "the full benchmark times fp16 and fp32 tables already")):
        if given and not args.sweep:
            print(f"{flag} applies to --sweep only ({why})", file=sys.stderr)
            raise SystemExit(2)
    if args.profile_step:
        by_name = {v.name: v for w in block_attention_workloads() for v in (w, whole_blocks(w))}
        if args.profile_step not in by_name:
            print(f"bench_block_attention: --profile-step takes one of {', '.join(sorted(by_name))}, got "
                  f"{args.profile_step!r}", file=sys.stderr)
            raise SystemExit(2)
        w = by_name[args.profile_step]
        q, k, v, off, _, _, _, grad = make_inputs(w)
        max_len = int(w.q_lengths.max())
        profile_step(api_pair(lambda q, k, v: ops.block_attention(q, k, v, off, max_len, block_size=64, rope=ROPE_BASE,
                                                                  backend="triton"), q, k, v, grad)[1], pins=pins)
        return
    rope_math = "bf16x2 on sm_90+ (both passes), else fp32" if args.packed_rope else "fp32"
    meta = {**base_meta(dtype="bfloat16", rope_base=ROPE_BASE, rope_math=rope_math), **ceilings()}
    print(meta, flush=True)
    if args.sweep:
        fwd = fwd_configs or block_kernels._FWD_CANDIDATES
        bwd = bwd_configs or block_kernels._BWD_CANDIDATES
        rows = sweep(args.only, [int(d) for d in args.dims.split(",")], fwd, bwd, meta["copy_tbps"],
                     whole=args.whole_blocks, table_dtype=TABLE_DTYPES.get(args.sweep_tables), trimmed=args.trimmed_tails)
        Path(args.out).write_text(json.dumps({"meta": meta, "sweep": rows}, indent=1, default=str))
        return
    rows = []
    for w in block_attention_workloads():
        if args.only and w.name not in args.only:
            continue
        rows.append(run_workload(w, meta["copy_tbps"]))
        r = rows[-1]["block"][64]
        print(json.dumps({"workload": w.name, "fwd_roofline_pct": r["fwd_roofline_pct"], "bwd_roofline_pct": r["bwd_roofline_pct"],
                          **{k: v for k, v in rows[-1].items() if "speedup" in k}}), flush=True)
        # written after every workload: a call cut off at its time limit keeps the finished ones
        meta["configs"] = picked_configs(("block_attention_fwd", "block_attention_bwd"))
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    print_tables(rows, meta)


if __name__ == "__main__":
    main()
