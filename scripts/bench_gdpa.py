"""Benchmark gemctl's Triton GDPA on pma-32, cross-32, cross-128 and self-1000 against padded
bmm -> activation -> bmm in PyTorch (eager and torch.compile) and the softmax jagged attention at
the same shape, with the roofline of each workload, in one process.

    python scripts/bench_gdpa.py [--out bench_gdpa.json]

Useful FLOPs: 4*H*D per (query, key) pair (two GEMMs), backward 2.5x. Bytes: q, k, v read once
and the output written once (bf16). Roofline = min(measured bf16 GEMM rate, measured copy
bandwidth x FLOPs / bytes), both ceilings measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_jagged_attention import bench, make_inputs, tflops  # noqa: E402
from gemctl import ops  # noqa: E402
from gemctl.metrics.flops import attention, attention_pairs  # noqa: E402
from workloads import cross_workload, pma_workload, self_workload  # noqa: E402


def ceilings() -> dict:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm_ms = bench(lambda: a @ b)
    x = torch.randn(2**30 // 2, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    copy_ms = bench(lambda: y.copy_(x))
    return {"gemm_tflops": 2 * 8192**3 / (gemm_ms * 1e-3) / 1e12, "copy_tbps": 2 * x.numel() * 2 / (copy_ms * 1e-3) / 1e12}


def run_gdpa(w, backend):
    q, k, v, qo, ko, _, _, grad = make_inputs(w)
    mq, mk = int(w.q_lengths.max()), int(w.k_lengths.max())

    def fwd():
        return ops.gdpa(q, k, v, qo, ko, mq, mk, activation="gelu", backend=backend)

    out = fwd()
    out.backward(grad, retain_graph=True)
    return bench(fwd), bench(lambda: out.backward(grad, retain_graph=True))


def run_softmax(w):
    q, k, v, qo, ko, _, _, grad = make_inputs(w)
    mq, mk = int(w.q_lengths.max()), int(w.k_lengths.max())

    def fwd():
        return ops.jagged_attention(q, k, v, qo, ko, mq, mk, backend="triton")

    out = fwd()
    out.backward(grad, retain_graph=True)
    return bench(fwd), bench(lambda: out.backward(grad, retain_graph=True))


def run_padded(w, compiled: bool):
    b, h, d = w.batch, w.heads, w.head_dim
    mq, mk = int(w.q_lengths.max()), int(w.k_lengths.max())
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, mq, d, generator=gen).to("cuda", torch.bfloat16).requires_grad_(True)
    k = torch.randn(b, h, mk, d, generator=gen).to("cuda", torch.bfloat16).requires_grad_(True)
    v = torch.randn(b, h, mk, d, generator=gen).to("cuda", torch.bfloat16).requires_grad_(True)
    g = torch.randn(b, h, mq, d, generator=gen).to("cuda", torch.bfloat16)
    kmask = (torch.arange(mk)[None, :] < w.k_lengths[:, None]).to("cuda", torch.bfloat16)[:, None, None, :]
    scale = d**-0.5

    def f(q, k, v):
        return torch.matmul(F.gelu(torch.matmul(q, k.transpose(-1, -2)) * scale) * kmask, v)

    fn = torch.compile(f) if compiled else f
    out = fn(q, k, v)
    out.backward(g, retain_graph=not compiled)
    ms_f = bench(lambda: fn(q, k, v))

    def fwd_bwd():
        fn(q, k, v).backward(g)

    return ms_f, bench(fwd_bwd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_gdpa.json")
    args = ap.parse_args()
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__}
    meta.update(ceilings())
    print(meta, flush=True)
    rows = []
    for w in [pma_workload(256, 32), cross_workload(256, 32), cross_workload(256, 128), self_workload(256, 1000)]:
        pairs = attention_pairs(w.q_lengths, w.k_lengths, causal=False)
        f_flops = attention(w.heads, w.head_dim, pairs)
        bytes_moved = 2 * w.heads * w.head_dim * (2 * int(w.q_lengths.sum()) + 2 * int(w.k_lengths.sum()))
        intensity = f_flops / bytes_moved
        roof = min(meta["gemm_tflops"], meta["copy_tbps"] * intensity)
        row = {"workload": w.name, "pairs": pairs, "intensity_flop_per_byte": intensity, "roofline_tflops": roof}
        impls = {"ours": lambda: run_gdpa(w, "triton"), "torch_reference": lambda: run_gdpa(w, "torch"),
                 "padded_eager": lambda: run_padded(w, False), "padded_compiled": lambda: run_padded(w, True),
                 "softmax_jagged": lambda: run_softmax(w)}
        for name, fn in impls.items():
            try:
                ms_f, ms_b = fn()
                row[name] = {"fwd_ms": ms_f, "fwd_tflops": tflops(f_flops, ms_f), "second_ms": ms_b,
                             "second_tflops": tflops((3.5 if name.startswith("padded") else 2.5) * f_flops, ms_b),
                             "second": "fwd+bwd" if name.startswith("padded") else "bwd"}
            except Exception as exc:
                row[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            torch.cuda.empty_cache()
        rows.append(row)
        ours = row["ours"]
        share = f"{100 * ours['fwd_tflops'] / roof:.0f}% of roofline" if "fwd_tflops" in ours else ours.get("error")
        print(f"{w.name:>10} intensity {intensity:7.1f} roof {roof:6.0f} | " + " | ".join(
            f"{n} {r['fwd_tflops']:.0f}/{r['second_tflops']:.0f}" if "fwd_tflops" in r else f"{n}: {r['error'][:50]}"
            for n, r in ((n, row[n]) for n in impls)) + f" | ours fwd {share}", flush=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
