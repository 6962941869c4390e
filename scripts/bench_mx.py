"""Benchmark the Triton MX quantize kernels against the device copy bandwidth of the same run.

    python scripts/bench_mx.py [--out bench_mx.json] [--tokens 65536]

Operands of the BENCHMARKS.md `mlp` shapes (tokens 65536; d 1024 -> 4096 -> 1024 and
d 2048 -> 8192 -> 2048), bf16 in, E4M3 + E8M0 out, rceil scales:

- quantize, blocks along the last axis: the forward operands (activations [T, d] and [T, 4d],
  weights [4d, d] and [d, 4d]) and the dgrad operands;
- quantize, blocks along axis 0: the wgrad operands (activations and gradients blocked along the
  tokens);
- fused RMSNorm -> quantize of the up-projection's input [T, d], with and without also writing
  the bf16 normalized activation; and, for comparison, the unfused pair (torch rms_norm, then
  the quantize kernel).

Bytes moved (the least any implementation moves): read 2 B per element (bf16), write 1 B
(E4M3) + 1 B per 32 elements (E8M0); the fused norm also reads the weight and, with the normed
output, writes 2 B more per element. GB/s = bytes / median time; "% of copy" compares with
y.copy_(x) of a 1 GiB bf16 tensor (read + write) timed in the same process. Each kernel is
timed twice: as a Python call (do_bench, launch included: it bounds the small weight operands)
and by CUDA-graph replay (GPU time, the kernel against the bandwidth bar). Target (issue 6):
quantize kernels at >= 80% of copy bandwidth. Each kernel is also checked bit-exact against
gemctl.precision.mx.quantize_mx on its input before it is timed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import bench, graph_bench, run_meta  # noqa: E402

from gemctl.ops.triton import mx_quant  # noqa: E402
from gemctl.precision.mx import quantize_mx  # noqa: E402

E4M3 = torch.float8_e4m3fn
MLP_WIDTHS = [(1024, 4096), (2048, 8192)]  # BENCHMARKS.md mlp: d -> 4d -> d






def quant_bytes(numel: int, block: int = 32) -> int:
    return numel * 2 + numel + triton.cdiv(numel, block)  # bf16 in, fp8 out, e8m0 scales out


def check_quant(x, axis: int) -> None:
    d, s = mx_quant.mx_quantize(x, axis=axis, scale_rule="rceil")
    rd, rs = quantize_mx(x, axis=axis, scale_rule="rceil")
    if not (torch.equal(s, rs) and torch.equal(d.view(torch.uint8), rd.view(torch.uint8))):
        raise SystemExit(f"bench_mx: mx_quantize differs from quantize_mx at {tuple(x.shape)} axis={axis}")


def rows(tokens: int, copy: float) -> list[dict]:
    out = []

    def add(name, shape, nbytes, fn):
        """Time ``fn`` as a Python call (launch included) and by CUDA-graph replay (GPU time)."""
        ms, graph_ms = bench(fn), graph_bench(fn, nan_on_failure=True)
        tbps, graph_tbps = nbytes / (ms * 1e-3) / 1e12, nbytes / (graph_ms * 1e-3) / 1e12
        out.append({"kernel": name, "shape": list(shape), "ms": ms, "gbps": tbps * 1e3, "pct_copy": 100 * tbps / copy,
                    "graph_ms": graph_ms, "graph_gbps": graph_tbps * 1e3, "graph_pct_copy": 100 * graph_tbps / copy})
        print(out[-1], flush=True)

    for d, hidden in MLP_WIDTHS:
        operands = {
            f"act [T,{d}]": (tokens, d), f"act [T,{hidden}]": (tokens, hidden),
            f"w_up [{hidden},{d}]": (hidden, d), f"w_down [{d},{hidden}]": (d, hidden),
        }
        for label, shape in operands.items():
            x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
            axes = (-1, 0) if label.startswith("act") else (-1,)  # wgrad operands: activations along T
            for axis in axes:
                check_quant(x, axis)
                add(f"quantize {label} axis={axis}", shape, quant_bytes(x.numel()),
                    lambda: mx_quant.mx_quantize(x, axis=axis, scale_rule="rceil"))
            del x
        x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
        w = 1 + 0.1 * torch.randn(d, device="cuda", dtype=torch.bfloat16)
        normed, data, scale = mx_quant.rmsnorm_mx_quantize(x, w, 1e-6, scale_rule="rceil", return_normed=True)
        rd, rs = quantize_mx(normed, scale_rule="rceil")
        if not (torch.equal(scale, rs) and torch.equal(data.view(torch.uint8), rd.view(torch.uint8))):
            raise SystemExit(f"bench_mx: rmsnorm_mx_quantize differs from quantize_mx at d={d}")
        base = quant_bytes(x.numel()) + 2 * d
        add(f"rmsnorm->quantize [T,{d}]", x.shape, base, lambda: mx_quant.rmsnorm_mx_quantize(x, w, 1e-6, scale_rule="rceil"))
        add(f"rmsnorm->quantize+normed [T,{d}]", x.shape, base + 2 * x.numel(),
            lambda: mx_quant.rmsnorm_mx_quantize(x, w, 1e-6, scale_rule="rceil", return_normed=True))

        def unfused():
            y = torch.nn.functional.rms_norm(x, (d,), w, 1e-6)
            return mx_quant.mx_quantize(y, scale_rule="rceil")

        # Same useful bytes as the fused kernel (the bf16 round trip is the overhead measured).
        add(f"unfused rms_norm + quantize [T,{d}]", x.shape, base, unfused)
        del x
    return out


def table(rows_: list[dict], meta: dict):
    from rich.table import Table

    t = Table(title=f"MX quantize on {meta['gpu']} (copy {meta['copy_tbps'] * 1e3:,.0f} GB/s, target >= 80% of copy)")
    for col in ("kernel", "shape", "call ms", "GB/s", "% of copy", "graph ms", "GB/s (graph)", "% of copy (graph)"):
        t.add_column(col, justify="left" if col == "kernel" else "right")
    for r in rows_:
        t.add_row(r["kernel"], "x".join(map(str, r["shape"])), f"{r['ms']:.3f}", f"{r['gbps']:,.0f}", f"{r['pct_copy']:.1f}%",
                  f"{r['graph_ms']:.3f}", f"{r['graph_gbps']:,.0f}", f"{r['graph_pct_copy']:.1f}%")
    return t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_mx.json")
    ap.add_argument("--tokens", type=int, default=65536)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mx: needs a CUDA GPU")
    from rich.console import Console

    meta = run_meta(tokens=args.tokens)
    result = rows(args.tokens, meta["copy_tbps"])
    Console().print(table(result, meta))
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": result}, indent=1))


if __name__ == "__main__":
    main()
