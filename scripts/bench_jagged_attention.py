"""Benchmark gemctl's Triton jagged attention against FA2 varlen (aten), flex_attention with a
document mask (compiled) and padded SDPA, on the GEM-like workloads, in one process.

    python scripts/bench_jagged_attention.py [--out results.json] [--quick] [--causal] [--window 256 ...]
    python scripts/bench_jagged_attention.py --sweep fwd --sweep dkdv --sweep dq [--out sweep.json]
    ncu ... python scripts/bench_jagged_attention.py --profile-step

Effective TFLOP/s count useful FLOPs only (gemctl.metrics.flops): forward 4*H*D*pairs with pairs
= sum_i Lq_i*Lk_i (non-causal) or the exact causal pair count; backward 2.5x forward (dQ, dK, dV
and the recomputed QK^T, as FlashAttention counts it). Timing: triton.testing.do_bench(warmup=25,
rep=200, median) after a warm-up that includes compilation and config selection: a call as eager
code pays it, host launch cost included (it bounds the short self-200 kernels). For ours and FA2
the kernels alone are also timed by CUDA-graph replay (triton.testing.do_bench_cudagraph): the
*_gpu_* fields, "graph" in the printed table.

--sweep PASS times every autotune candidate of a pass forced in turn (fwd: the forward; dkdv, dq:
the whole backward, CUDA-graph replay), on self-200/500/1000 non-causal and self-1000 causal with
the relative-position bias, against FA2 varlen in the same run; outputs are compared with the
first candidate's (the untransposed 32x64 dK/dV tiles were caught that way).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (  # noqa: E402
    add_pin_argument, base_meta, graph_bench, parse_pins, picked_configs, profile_step,
)
from gemctl import ops  # noqa: E402
from gemctl.metrics.flops import attention, attention_pairs  # noqa: E402
from gemctl.ops import host  # noqa: E402
from workloads import attention_workloads, offsets_of  # noqa: E402


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def make_inputs(w, device="cuda", dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    qo_h, ko_h = offsets_of(w.q_lengths), offsets_of(w.k_lengths)
    nq, nk = int(qo_h[-1]), int(ko_h[-1])

    def rnd(n):
        return torch.randn(n, w.heads, w.head_dim, generator=gen).to(device, dtype).requires_grad_(True)

    q, k, v = rnd(nq), rnd(nk), rnd(nk)
    qo = host.register(qo_h.to(device), qo_h)
    ko = qo if w.q_lengths.equal(w.k_lengths) else host.register(ko_h.to(device), ko_h)
    grad = torch.randn(nq, w.heads, w.head_dim, generator=gen).to(device, dtype)
    return q, k, v, qo, ko, qo_h, ko_h, grad


def run_ours(w, causal, with_bias, window=None):
    q, k, v, qo, ko, _, _, grad = make_inputs(w)
    mq, mk = int(w.q_lengths.max()), int(w.k_lengths.max())
    bias = None
    if with_bias:
        table = torch.randn(w.heads, 32, device="cuda", requires_grad=True)
        bias = ops.RelativePositionBias(table, 1024)

    def fwd():
        return ops.jagged_attention(q, k, v, qo, ko, mq, mk, bias=bias, causal=causal, window=window,
                                    backend="triton")

    out = fwd()
    out.backward(grad, retain_graph=True)
    ms_f = bench(fwd)
    ms_b = bench(lambda: out.backward(grad, retain_graph=True))
    if window is not None:
        return ms_f, ms_b
    # The kernels alone (CUDA-graph replay, same autotuned configs): what the GPU spends, without
    # the Python launch cost that bounds a call on short workloads.
    from gemctl.ops.triton import jagged_attention as kernels

    qd, kd, vd, scale = q.detach(), k.detach(), v.detach(), w.head_dim**-0.5
    o, lse, _ = kernels._forward(qd, kd, vd, qo, ko, mq, mk, bias, causal, scale, 0)
    gpu_f = graph_bench(lambda: kernels._forward(qd, kd, vd, qo, ko, mq, mk, bias, causal, scale, 0),
                        nan_on_failure=True)
    gpu_b = graph_bench(lambda: kernels._backward(grad, qd, kd, vd, o, lse, qo, ko, mq, mk, bias, causal, scale, 0),
                        nan_on_failure=True)
    return ms_f, ms_b, gpu_f, gpu_b


def run_fa2(w, causal, eager: bool = True):
    """(fwd, bwd) call ms and (fwd, bwd) CUDA-graph ms of FA2 varlen; only the graph pair when not ``eager``."""
    q, k, v, _, _, qo_h, ko_h, grad = make_inputs(w)
    cq = qo_h.to("cuda", torch.int32)
    ck = ko_h.to("cuda", torch.int32)
    mq, mk = int(w.q_lengths.max()), int(w.k_lengths.max())
    scale = w.head_dim**-0.5
    qd, kd, vd = q.detach(), k.detach(), v.detach()

    def fwd():
        return torch.ops.aten._flash_attention_forward(qd, kd, vd, cq, ck, mq, mk, 0.0, causal, False, scale=scale)

    out, lse, rng, unused, _ = fwd()

    def bwd():
        return torch.ops.aten._flash_attention_backward(grad, qd, kd, vd, out, lse, cq, ck, mq, mk, 0.0, causal, rng, unused, scale=scale)

    bwd()
    graph = graph_bench(fwd, nan_on_failure=True), graph_bench(bwd, nan_on_failure=True)
    return (bench(fwd), bench(bwd), *graph) if eager else graph


def run_flex(w, causal):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v, _, _, qo_h, ko_h, grad = make_inputs(w)
    nq, nk = q.shape[0], k.shape[0]
    doc_q = torch.repeat_interleave(torch.arange(w.batch), w.q_lengths).cuda()
    doc_k = torch.repeat_interleave(torch.arange(w.batch), w.k_lengths).cuda()
    pos_q = (torch.arange(nq) - torch.repeat_interleave(qo_h[:-1], w.q_lengths)).cuda()
    pos_k = (torch.arange(nk) - torch.repeat_interleave(ko_h[:-1], w.k_lengths)).cuda()
    shift = (w.k_lengths - w.q_lengths).cuda()

    def mask_mod(b, h, qi, ki):
        same = doc_q[qi] == doc_k[ki]
        if causal:
            return same & (pos_k[ki] <= pos_q[qi] + shift[doc_q[qi]])
        return same

    block_mask = create_block_mask(mask_mod, 1, 1, nq, nk, device="cuda")
    flex = torch.compile(flex_attention)
    q4, k4, v4 = (t.detach().transpose(0, 1)[None].requires_grad_(True) for t in (q, k, v))
    g4 = grad.transpose(0, 1)[None]

    def fwd():
        return flex(q4, k4, v4, block_mask=block_mask)

    fwd().backward(g4)  # compile forward and backward (compiled backward cannot retain its graph)
    ms_f = bench(fwd)

    def fwd_bwd():
        o = flex(q4, k4, v4, block_mask=block_mask)
        o.backward(g4)

    return ms_f, bench(fwd_bwd)


def run_padded_sdpa(w, causal):
    """Padded batch through SDPA's flash backend (no mask: padding computed and discarded)."""
    b, h, d = w.batch, w.heads, w.head_dim
    mq, mk = int(w.q_lengths.max()), int(w.k_lengths.max())
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(b, h, mq, d, generator=gen).to("cuda", torch.bfloat16).requires_grad_(True)
    k = torch.randn(b, h, mk, d, generator=gen).to("cuda", torch.bfloat16).requires_grad_(True)
    v = torch.randn(b, h, mk, d, generator=gen).to("cuda", torch.bfloat16).requires_grad_(True)
    g = torch.randn(b, h, mq, d, generator=gen).to("cuda", torch.bfloat16)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        def fwd():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal and mq == mk)

        out = fwd()
        out.backward(g, retain_graph=True)
        return bench(fwd), bench(lambda: out.backward(g, retain_graph=True))


def sweep(passes: list[str]) -> list[dict]:
    """Each autotune candidate of each pass in ``passes`` (fwd, dkdv, dq) forced in turn: the
    forward alone, or the whole backward (delta, dK/dV and dQ launchers) for dkdv / dq, timed by
    CUDA-graph replay against FA2 varlen in the same run; outputs compared with the first
    candidate's (max |difference|)."""
    from gemctl.ops.triton import common
    from gemctl.ops.triton import jagged_attention as kernels
    from workloads import self_workload

    rows = []
    cases = [(self_workload(512, 200), False, False), (self_workload(512, 500), False, False),
             (self_workload(256, 1000), False, False), (self_workload(256, 1000), True, True)]
    for w, causal, with_bias in cases:
        q, k, v, qo, ko, _, _, grad = make_inputs(w)
        mq = mk = int(w.q_lengths.max())
        bias = ops.RelativePositionBias(torch.randn(w.heads, 32, device="cuda"), 1024) if with_bias else None
        scale = w.head_dim**-0.5
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        out, lse, _ = kernels._forward(qd, kd, vd, qo, ko, mq, mk, bias, causal, scale, 0)
        fa2 = (float("nan"), float("nan")) if with_bias else run_fa2(w, causal, eager=False)  # CUDA-graph replay too

        def backward():  # dq, dk, dv and, with the bias, its table's gradient (the dQ pass makes it)
            grads = kernels._backward(grad, qd, kd, vd, out, lse, qo, ko, mq, mk, bias, causal, scale, 0)
            return tuple(g for g in grads if g is not None)

        calls = {
            "fwd": (lambda: kernels._forward(qd, kd, vd, qo, ko, mq, mk, bias, causal, scale, 0)[:1], fa2[0],
                    kernels._FWD_CANDIDATES["large" if w.head_dim >= 128 else "small"]),
            "dkdv": (backward, fa2[1], kernels._DKDV_CANDIDATES),
            "dq": (backward, fa2[1], kernels._DQ_CANDIDATES),
        }
        for name in passes:
            call, fa2_ms, candidates = calls[name]
            first = None
            for cfg in candidates:
                try:
                    with common.forced_config({name: cfg}):
                        got = call()
                        ms = graph_bench(call)
                except Exception as exc:  # a config that does not fit
                    print(f"{w.name:>10} causal={int(causal)} {name} {cfg}: {type(exc).__name__}", flush=True)
                    continue
                first = first or got
                diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, first))
                rows.append({"workload": w.name, "causal": causal, "bias": with_bias, "pass": name, "config": list(cfg),
                             "ms": ms, "fa2_ms": fa2_ms, "max_diff_vs_first": diff})
                print(f"{w.name:>10} causal={int(causal)} bias={int(with_bias)} {name:4s} {str(cfg):22s} {ms:.3f} ms "
                      f"(FA2 {fa2_ms:.3f} ms: {fa2_ms / ms:.2f}x) diff {diff:.1e}", flush=True)
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_jagged_attention.json")
    ap.add_argument("--quick", action="store_true", help="self-* heavy-tailed workloads only, no flex")
    ap.add_argument("--causal", action="store_true", help="also run causal variants")
    ap.add_argument("--window", type=int, action="append", default=[],
                    help="sliding windows to time (ours, causal, self-* workloads), against no window")
    ap.add_argument("--sweep", choices=["fwd", "dkdv", "dq"], action="append", default=[],
                    help="time each autotune candidate of this pass, forced (repeatable)")
    ap.add_argument("--profile-step", action="store_true",
                    help="self-1000 (non-causal) forward+backward, the last of 4 between profiler start and stop (ncu)")
    add_pin_argument(ap)
    args = ap.parse_args()
    pins = parse_pins(args.pin, bool(args.profile_step))
    meta = base_meta()
    print(meta)
    if args.profile_step:  # for ncu --profile-from-start off: warm-up (compilation, autotuning), then
        from workloads import self_workload  # one forward+backward between profiler start and stop (bench_common)

        w = self_workload(256, 1000)
        q, k, v, qo, ko, _, _, grad = make_inputs(w)
        m = int(w.q_lengths.max())
        profile_step(lambda: ops.jagged_attention(q, k, v, qo, ko, m, m, backend="triton").backward(grad), pins=pins)
        return
    if args.sweep:
        Path(args.out).write_text(json.dumps({"meta": meta, "sweep": sweep(args.sweep)}, indent=1))
        return
    results = []
    workloads = attention_workloads(uniform_variant=not args.quick)
    if args.quick:
        workloads = [w for w in workloads if w.name.startswith("self")]
    for causal in ([False, True] if args.causal else [False]):
        for w in workloads:
            pairs = attention_pairs(w.q_lengths, w.k_lengths, causal)
            f_flops = attention(w.heads, w.head_dim, pairs)
            row = {"workload": w.name, "causal": causal, "pairs": pairs}
            impls = {
                "ours": lambda: run_ours(w, causal, False),
                "ours+bias": lambda: run_ours(w, causal, True),
                "fa2_varlen": lambda: run_fa2(w, causal),
                "padded_sdpa": lambda: run_padded_sdpa(w, causal),
            }
            if not args.quick and w.name.startswith("self") and "uniform" not in w.name:
                impls["flex_docmask"] = lambda: run_flex(w, causal)  # compiled per shape: slow to set up
            for name, fn in impls.items():
                try:
                    ms_f, ms_b, *gpu = fn()
                    if name == "flex_docmask":  # measured fwd and fwd+bwd
                        row[name] = {"fwd_ms": ms_f, "fwd_tflops": tflops(f_flops, ms_f),
                                     "fwdbwd_ms": ms_b, "fwdbwd_tflops": tflops(3.5 * f_flops, ms_b)}
                    else:
                        row[name] = {"fwd_ms": ms_f, "fwd_tflops": tflops(f_flops, ms_f),
                                     "bwd_ms": ms_b, "bwd_tflops": tflops(2.5 * f_flops, ms_b)}
                    if gpu:  # kernels alone, CUDA-graph replay
                        row[name].update({"fwd_gpu_ms": gpu[0], "fwd_gpu_tflops": tflops(f_flops, gpu[0]),
                                          "bwd_gpu_ms": gpu[1], "bwd_gpu_tflops": tflops(2.5 * f_flops, gpu[1])})
                except Exception as exc:  # report, keep going
                    row[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
                torch.cuda.empty_cache()
            results.append(row)
            cells = []
            for name in impls:
                r = row[name]
                if "error" in r:
                    cells.append(f"{name}: {r['error'][:60]}")
                elif "bwd_tflops" in r:
                    gpu = f" (graph {r['fwd_gpu_tflops']:.0f}/{r['bwd_gpu_tflops']:.0f})" if "fwd_gpu_tflops" in r else ""
                    cells.append(f"{name} {r['fwd_tflops']:.0f}/{r['bwd_tflops']:.0f}{gpu}")
                else:
                    cells.append(f"{name} {r['fwd_tflops']:.0f}/{r['fwdbwd_tflops']:.0f}(f+b)")
            print(f"{w.name:>18} causal={int(causal)} | " + " | ".join(cells), flush=True)
    windows = []
    for w in [w for w in workloads if w.name.startswith("self")] if args.window else []:
        full_f, full_b, *_ = run_ours(w, True, False)
        for win in args.window:
            ms_f, ms_b = run_ours(w, True, False, window=win)
            windows.append({"workload": w.name, "window": win, "fwd_ms": ms_f, "bwd_ms": ms_b,
                            "full_causal_fwd_ms": full_f, "full_causal_bwd_ms": full_b})
            print(f"{w.name:>18} window={win:<5} fwd {ms_f:.3f} ms ({full_f / ms_f:.2f}x vs causal full) | "
                  f"bwd {ms_b:.3f} ms ({full_b / ms_b:.2f}x)", flush=True)
    meta["configs"] = picked_configs(("fwd", "dkdv", "dq"))
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results, "windows": windows}, indent=1))


if __name__ == "__main__":
    main()
