"""Benchmark the FP8 GEMMs and the FP8 MLP block against BF16 on the BENCHMARKS.md `mlp` shapes.

    python scripts/bench_fp8.py [--out bench_fp8.json] [--tokens 65536] [--only mlp,cast,gemm]
                                [--grans row] [--mlp "bf16 compiled,fp8 row fused+norm"] [--widths 1024]

Everything in one run, on one GPU (``--only`` picks sections, run in the order given; a cold
Triton cache makes the gemm section the slow one: every shape autotunes its row-wise, promoted
and token-chunk variants):

1. ceilings: device copy bandwidth (1 GiB bf16 copy) and, per GEMM shape, torch's BF16 GEMM and
   torch's FP8 row-wise ``_scaled_mm`` (cuBLAS) as anchors;
2. GEMMs: every GEMM of the MLP block (forward, dgrad, wgrad of the up- and down-projections)
   in TF/s: ours row-wise, block-wise 128 and MX 32 (gemctl.ops.triton.fp8_gemm) against the
   anchors, and the row-wise GEMMs under each two-programs-per-SM config pinned;
3. MLP block ``rms_norm -> up -> silu -> down`` (tokens x d -> 4d -> d), forward and
   forward+backward: BF16 eager and BF16 torch.compile against ``fp8_mlp`` (row-wise, fused
   producers; "+norm": the pre-norm fused into the first cast, as the model runs it) and the
   unfused FP8 linears of each granularity; the speed-ups use the faster BF16; the norm weight
   is trained in every variant;
4. casts: the FP8 cast kernels' bandwidth against the copy bandwidth (read 2 B + write 1 B per
   element per output written, 1 B per scale), timed as a Python call and by CUDA-graph replay;
5. accuracy: relative error (Frobenius) of y = x W^T against float64 for each granularity, on
   Gaussian x and on x with 8 outlier features (x100, as LLM/recsys activations have);
   outliers: the same question on the emulated numerics (runs on a CPU too) for outlier scales
   1..10^5, with the error of the small features reported apart, and the row format after a
   Hadamard rotation (precision.fp8.hadamard) beside the others;
6. accumulation: the GEMM's own error against float64 per contraction length (FP32 promotion on
   and off, cuBLAS fast and exact accumulation as anchors);
7. profile: CUDA time per kernel of the fused MLP's forward+backward.

Weights are bf16 in every variant (the trainer's fp32 masters cast once per step either way).
Times: median of triton.testing.do_bench over the Python call (launch overheads included); the
MLP block's forward+backward also by CUDA-graph replay (GPU time: what the block costs inside a
step whose host work runs ahead);
FP8 outputs are checked against the emulated numerics (gemctl.precision.fp8_linear) before timing.
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

from bench_common import base_meta, bench, graph_bench, picked_configs, run_meta  # noqa: E402

from gemctl.ops.triton.fp8_gemm import (  # noqa: E402
    TOKEN_CHUNK, amax_rows_for, fp8_cast_cols, fp8_cast_rows, fp8_gemm, fp8_rmsnorm_cast_rows,
)
from gemctl.ops.triton import fp8_gemm as fp8_kernels  # noqa: E402
from gemctl.ops.triton.common import forced_config, tuning_seconds  # noqa: E402
from gemctl.ops.triton.mx_quant import mx_quantize  # noqa: E402
from gemctl.precision.fp8_linear import GRANULARITIES, Fp8Recipe, fp8_mlp, qdq  # noqa: E402

MLP_WIDTHS = [(1024, 4096), (2048, 8192)]
BF16 = torch.bfloat16






_ON_ROW = None  # set by main(): called with a section's rows after each row is added


class _Rows(list):
    """A section's rows; each append hands them to main(), which rewrites the JSON, so a run cut
    by its time limit keeps every row it timed, not only the sections it finished."""

    def append(self, row) -> None:
        super().append(row)
        if _ON_ROW is not None:
            _ON_ROW(self)


def operands(t: torch.Tensor, group: int):
    """(data, scale) of a K-major tensor for ``fp8_gemm`` at this granularity."""
    if group == 0:
        return fp8_cast_rows(t)
    return mx_quantize(t, block=group, scale_rule="rceil")


def scaled_mm_operands(t: torch.Tensor):
    amax = t.abs().amax(1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / 448.0
    return (t.float() / scale).to(torch.float8_e4m3fn), scale


def two_per_sm(row: dict, name: str, flops: int, call) -> None:
    """TF/s of ``call`` with each two-programs-per-SM GEMM config pinned (pending until the GPU
    tier passes them, so autotuning does not time them): ``row[name]`` the best, and every one's."""
    timed = {}
    for cfg in fp8_kernels._GEMM_TWO_PER_SM:
        with forced_config({"fp8_gemm": cfg}):
            try:
                timed[str(cfg)] = flops / bench(call) / 1e9
            except Exception as e:  # a config that does not fit: said, not fatal
                print(f"bench_fp8: {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
    row[name] = max(timed.values(), default=float("nan"))
    row[name + " (each)"] = timed


def gemm_rows(tokens: int, grans=tuple(GRANULARITIES), widths=None) -> list[dict]:
    out = _Rows()
    for d, h in MLP_WIDTHS:
        if widths and d not in widths:
            continue
        shapes = {  # name: (M, N, K) of C[M, N] = A[M, K] B[N, K]^T
            f"up fwd d={d}": (tokens, h, d), f"down fwd d={d}": (tokens, d, h),
            f"up dgrad d={d}": (tokens, d, h), f"down dgrad d={d}": (tokens, h, d),
            f"up wgrad d={d}": (h, d, tokens), f"down wgrad d={d}": (d, h, tokens),
        }
        for name, (m, n, k) in shapes.items():
            a = torch.randn(m, k, device="cuda", dtype=BF16)
            b = torch.randn(n, k, device="cuda", dtype=BF16)
            flops = 2 * m * n * k
            row = {"gemm": name, "shape": [m, n, k]}
            row["bf16"] = flops / bench(lambda: a @ b.t()) / 1e9
            a8, sa = scaled_mm_operands(a)
            b8, sb = scaled_mm_operands(b)
            row["scaled_mm_row"] = flops / bench(lambda: torch._scaled_mm(a8, b8.t(), sa, sb.t(), out_dtype=BF16)) / 1e9
            for gran, group in GRANULARITIES.items():
                if gran not in grans:
                    continue
                qa, qsa = operands(a, group)
                qb, qsb = operands(b, group)
                c = fp8_gemm(qa, qb, qsa, qsb, group_k=group)
                ref = qdq(a, group, 1) @ qdq(b, group, 1).t()
                err = ((c.float() - ref).norm() / ref.norm()).item()
                if err > 1e-2:
                    raise SystemExit(f"bench_fp8: {gran} GEMM {name} differs from the emulated numerics ({err:.2e})")
                row[gran] = flops / bench(lambda: fp8_gemm(qa, qb, qsa, qsb, group_k=group)) / 1e9
                if group == 0:
                    two_per_sm(row, "row, 2 programs/SM", flops, lambda: fp8_gemm(qa, qb, qsa, qsb))
                if group == 0 and "wgrad" in name:  # default: FP32 promotion every 4096 tokens
                    row["row, one tensor-core sum"] = flops / bench(
                        lambda: fp8_gemm(qa, qb, qsa, qsb, promote_every=None)) / 1e9
                    ca, csa = mx_quantize(a, block=TOKEN_CHUNK, scale_rule="rceil")  # what the MLP's wgrad runs
                    cb, csb = mx_quantize(b, block=TOKEN_CHUNK, scale_rule="rceil")
                    row["row, token-chunk scales (used)"] = flops / bench(
                        lambda: fp8_gemm(ca, cb, csa, csb, group_k=TOKEN_CHUNK)) / 1e9
                    two_per_sm(row, "token-chunk, 2 programs/SM", flops,
                               lambda: fp8_gemm(ca, cb, csa, csb, group_k=TOKEN_CHUNK))
                if group == 0 and name.startswith("down dgrad"):  # the MLP's fused silu' epilogue
                    pre = torch.randn(m, n, device="cuda", dtype=BF16)
                    row["row+silu_bwd"] = flops / bench(
                        lambda: fp8_gemm(qa, qb, qsa, qsb, epilogue="silu_bwd", pre=pre)) / 1e9
                    two_per_sm(row, "row+silu_bwd, 2 programs/SM", flops,
                               lambda: fp8_gemm(qa, qb, qsa, qsb, epilogue="silu_bwd", pre=pre))
                    del pre
            print(row, flush=True)
            out.append(row)
            del a, b, a8, b8
    return out


def mlp_variants(d: int, h: int):
    up = torch.randn(h, d, device="cuda", dtype=BF16) / d**0.5
    down = torch.randn(d, h, device="cuda", dtype=BF16) / h**0.5
    norm_w = torch.ones(d, device="cuda", dtype=BF16)
    up.requires_grad_(True)
    down.requires_grad_(True)
    norm_w.requires_grad_(True)  # trained, as in the model: every variant computes its gradient

    def bf16(x):
        return F.linear(F.silu(F.linear(F.rms_norm(x, (d,), norm_w, 1e-6), up)), down)

    variants = {"bf16 eager": bf16, "bf16 compiled": torch.compile(bf16)}
    for gran in GRANULARITIES:
        recipe = Fp8Recipe(granularity=gran, fused_mlp=gran == "row")
        label = "fp8 row fused" if gran == "row" else f"fp8 {gran}"
        variants[label] = lambda x, r=recipe: fp8_mlp(F.rms_norm(x, (d,), norm_w, 1e-6), up, down, r)
    # The model's path: the pre-norm fused into the block's first cast (fp8_rmsnorm_cast_rows).
    variants["fp8 row fused+norm"] = lambda x: fp8_mlp(x, up, down, Fp8Recipe(), norm_weight=norm_w, eps=1e-6)
    variants["fp8 row unfused"] = lambda x: fp8_mlp(
        F.rms_norm(x, (d,), norm_w, 1e-6), up, down, Fp8Recipe(granularity="row", fused_mlp=False))
    # precision.fp8.hadamard: the forward operands rotated along K first (two rotated linears)
    variants["fp8 row hadamard128"] = lambda x: fp8_mlp(
        F.rms_norm(x, (d,), norm_w, 1e-6), up, down, Fp8Recipe(granularity="row", hadamard=128))
    return variants, (up, down, norm_w)


def mlp_rows(tokens: int, only=None, widths=None) -> list[dict]:
    out = _Rows()
    for d, h in MLP_WIDTHS:
        if widths and d not in widths:
            continue
        variants, params = mlp_variants(d, h)
        if only:
            variants = {k: v for k, v in variants.items() if k in only or k == "bf16 eager"}
        x = torch.randn(tokens, d, device="cuda", dtype=BF16, requires_grad=True)
        gy = torch.randn(tokens, d, device="cuda", dtype=BF16)
        flops = 2 * 2 * tokens * d * h  # two GEMMs forward; backward 2x
        # outputs for the error without autograd graphs: a graph kept alive holds the leaves'
        # AccumulateGrad nodes, made on the default stream, and the CUDA-graph capture of
        # forward+backward below (on a side stream) then fails
        with torch.no_grad():
            ref = variants["bf16 eager"](x).float()
        for name, fn in variants.items():
            with torch.no_grad():
                y = fn(x)
            err = ((y.float() - ref).norm() / ref.norm()).item()
            del y
            fwd = bench(lambda: fn(x))

            def step():
                fn(x).backward(gy)

            both = bench(step, grad_to_none=[x, *params])
            # GPU time (CUDA-graph replay): no launch or autograd-engine cost; the gradients are
            # returned (autograd.grad) rather than accumulated, as the timed step sets them to None
            both_graph = graph_bench(lambda: torch.autograd.grad(fn(x), [x, *params], gy), nan_on_failure=True)
            row = {"mlp": name, "d": d, "hidden": h, "tokens": tokens, "fwd_ms": fwd, "fwd_bwd_ms": both,
                   "fwd_bwd_graph_ms": both_graph, "fwd_tflops": flops / fwd / 1e9,
                   "fwd_bwd_tflops": 3 * flops / both / 1e9, "rel_err_vs_bf16": err}
            print(row, flush=True)
            out.append(row)
        best_fwd = min(r["fwd_ms"] for r in out if r["d"] == d and r["mlp"].startswith("bf16"))
        best_both = min(r["fwd_bwd_ms"] for r in out if r["d"] == d and r["mlp"].startswith("bf16"))
        best_graph = min((r["fwd_bwd_graph_ms"] for r in out if r["d"] == d and r["mlp"].startswith("bf16")),
                         key=lambda t: float("inf") if t != t else t)  # NaN (capture failed) last
        for r in out:
            if r["d"] == d:
                r["fwd_speedup"] = best_fwd / r["fwd_ms"]
                r["fwd_bwd_speedup"] = best_both / r["fwd_bwd_ms"]
                r["fwd_bwd_graph_speedup"] = best_graph / r["fwd_bwd_graph_ms"]
        del x, gy, variants
    return out


AMAX_SWEEP = (16, 32, 64, 128)  # rows per column scale byte, timed for the plain row cast


def is_mlp_cast(name: str, runs: int, roles=("d", "4d")) -> bool:
    """Whether a cast of cast_rows is one the fused FP8 MLP block runs on its activations
    (fp8_linear: the RMSNorm-fused rows with column bytes and the column cast recomputing the norm
    on x, at width d; SiLU's pair on the hidden pre-activations, at 4d; the plain pair on the
    output gradient at d and on the pre-activations' gradient at 4d): a row cast with column bytes
    at the linears' run length, or a column cast from such bytes. ``roles``: the widths' roles to
    keep the casts of ("d": the RMSNorm and plain pairs; "4d": the SiLU and plain pairs); both,
    the default, keep all six."""
    if not ((name.startswith("rows + column maxima") and name.endswith(f", {runs}-row runs"))
            or (name.startswith("cols transposed") and name.endswith("from column maxima"))):
        return False
    if "RMSNorm" in name:
        return "d" in roles
    return "silu" not in name or "4d" in roles


def block_roles(cols: int) -> tuple:
    """The roles a row width plays in BENCHMARKS.md's mlp shapes (MLP_WIDTHS): "d" (the block's input
    and output gradient), "4d" (its hidden activations); () for a width of neither."""
    return tuple(role for role, i in (("d", 0), ("4d", 1)) if any(shape[i] == cols for shape in MLP_WIDTHS))


def cast_rows(tokens: int, copy: float, widths=(1024, 4096, 8192), amax_sweep: bool = False,
              cast_set: str = "all") -> list[dict]:
    """Bytes: read 2 B (bf16), write 1 B per element, 1 B per scale; the column scale bytes a row
    cast leaves for the column cast (1 B per column and run of amax_rows_for rows, the run length
    the linears use) are written by one and read by the other. ``amax_sweep``: the SiLU and
    RMSNorm row casts with column maxima, and the column casts from their maxima, at every run
    length of AMAX_SWEEP too (the plain row cast sweeps them always): which run length the fused
    MLP's casts should take. ``cast_set``: "all"; "mlp", the six casts the fused MLP block runs
    (is_mlp_cast) at every width; "block", those it runs at each width's role in the mlp shapes
    (block_roles: four at d or at 4d; the two pairs it does not run there are left out)."""
    out = _Rows()
    runs = amax_rows_for(TOKEN_CHUNK, tokens)
    for cols in widths:
        x = torch.randn(tokens, cols, device="cuda", dtype=BF16)
        n = x.numel()
        part_bytes = cols * -(-tokens // runs)
        col_scales = cols * -(-tokens // TOKEN_CHUNK)
        cases = {}
        roles = block_roles(cols) if cast_set == "block" else ("d", "4d")  # "block": what the block runs here
        for act in (None, "silu") if "4d" in roles else (None,):
            on = ", silu on the fly" if act else ""
            part = fp8_cast_rows(x, act=act, col_amax=True)[2]
            cases[f"rows{on}"] = (lambda act=act: fp8_cast_rows(x, act=act), 3 * n + tokens)
            if part is not None:
                cases[f"rows + column maxima{on}, {runs}-row runs"] = (
                    lambda act=act: fp8_cast_rows(x, act=act, col_amax=True), 3 * n + tokens + part_bytes)
            if part is not None and act is None:
                for ar in (a for a in AMAX_SWEEP if a != runs):
                    cases[f"rows + column maxima, {ar}-row runs"] = (
                        lambda ar=ar: fp8_cast_rows(x, col_amax=True, amax_rows=ar), 3 * n + tokens + cols * -(-tokens // ar))
            cases[f"cols transposed{on}, {TOKEN_CHUNK}-token chunks, 2 reads"] = (
                lambda act=act: fp8_cast_cols(x, act=act), 3 * n + col_scales)
            if part is not None:
                cases[f"cols transposed{on}, {TOKEN_CHUNK}-token chunks, from column maxima"] = (
                    lambda act=act, part=part: fp8_cast_cols(x, act=act, part=part), 3 * n + col_scales + part_bytes)
        if "d" in roles:  # the RMSNorm casts ("block" at 4d: not run there, not autotuned)
            # The MLP's pre-norm fused into the row cast (rstd written, 4 B per row) and recomputed by
            # the column cast; torch's rms_norm alone (read 2 B, write 2 B) as the unfused producer.
            nw = torch.rand(cols, device="cuda", dtype=BF16) + 0.5
            _, _, rstd, npart = fp8_rmsnorm_cast_rows(x, nw, 1e-6, col_amax=True)
            cases["torch rms_norm (bf16 out)"] = (lambda: F.rms_norm(x, (cols,), nw, 1e-6), 4 * n)
            cases["rows, RMSNorm fused"] = (lambda: fp8_rmsnorm_cast_rows(x, nw, 1e-6), 3 * n + 5 * tokens)
            cases[f"rows + column maxima, RMSNorm fused, {runs}-row runs"] = (
                lambda: fp8_rmsnorm_cast_rows(x, nw, 1e-6, col_amax=True), 3 * n + 5 * tokens + part_bytes)
            cases[f"cols transposed, RMSNorm recomputed, {TOKEN_CHUNK}-token chunks, from column maxima"] = (
                lambda: fp8_cast_cols(x, norm=(rstd, nw), part=npart), 3 * n + col_scales + part_bytes + 4 * tokens)
            sweep = [a for a in AMAX_SWEEP if a != runs] if amax_sweep and npart is not None else []
            for ar in sweep:
                ar_part = cols * -(-tokens // ar)
                ppart = fp8_cast_rows(x, col_amax=True, amax_rows=ar)[2]
                spart = fp8_cast_rows(x, act="silu", col_amax=True, amax_rows=ar)[2]
                rpart = fp8_rmsnorm_cast_rows(x, nw, 1e-6, col_amax=True, amax_rows=ar)[3]
                cases[f"cols transposed, {TOKEN_CHUNK}-token chunks, from {ar}-row column maxima"] = (
                    lambda ar=ar, p=ppart: fp8_cast_cols(x, part=p, amax_rows=ar), 3 * n + col_scales + ar_part)
                cases[f"rows + column maxima, silu on the fly, {ar}-row runs"] = (
                    lambda ar=ar: fp8_cast_rows(x, act="silu", col_amax=True, amax_rows=ar), 3 * n + tokens + ar_part)
                cases[f"cols transposed, silu on the fly, {TOKEN_CHUNK}-token chunks, from {ar}-row column maxima"] = (
                    lambda ar=ar, p=spart: fp8_cast_cols(x, act="silu", part=p, amax_rows=ar), 3 * n + col_scales + ar_part)
                cases[f"rows + column maxima, RMSNorm fused, {ar}-row runs"] = (
                    lambda ar=ar: fp8_rmsnorm_cast_rows(x, nw, 1e-6, col_amax=True, amax_rows=ar),
                    3 * n + 5 * tokens + ar_part)
                cases[f"cols transposed, RMSNorm recomputed, {TOKEN_CHUNK}-token chunks, from {ar}-row column maxima"] = (
                    lambda ar=ar, p=rpart: fp8_cast_cols(x, norm=(rstd, nw), part=p, amax_rows=ar),
                    3 * n + col_scales + ar_part + 4 * tokens)
        if cast_set != "all":
            cases = {name: case for name, case in cases.items() if is_mlp_cast(name, runs, roles)}
            expected = 2 + 2 * len(roles)
            if len(cases) != expected:  # the case names and is_mlp_cast must agree
                raise RuntimeError(f"bench_fp8 --cast-set {cast_set}: {len(cases)} casts matched at {cols} columns, "
                                   f"{expected} expected")
        for name, (fn, nbytes) in cases.items():
            # Python call (launch included) and CUDA-graph replay (the kernel's GPU time, which
            # the bandwidth bar is about: launches cost a C=1024 cast a visible share)
            ms, graph_ms = bench(fn), graph_bench(fn, nan_on_failure=True)
            out.append({"cast": name, "shape": [tokens, cols], "ms": ms, "pct_copy": 100 * nbytes / (ms * 1e-3) / 1e12 / copy,
                        "graph_ms": graph_ms, "graph_pct_copy": 100 * nbytes / (graph_ms * 1e-3) / 1e12 / copy})
            print(out[-1], flush=True)
        del x
    return out


def accuracy_rows() -> list[dict]:
    out = _Rows()
    gen = torch.Generator(device="cuda").manual_seed(0)
    m, k, n = 4096, 2048, 2048
    w = torch.randn(n, k, device="cuda", generator=gen) / k**0.5
    for data in ("gaussian", "outlier features"):
        x = torch.randn(m, k, device="cuda", generator=gen)
        if data != "gaussian":
            x[:, torch.randperm(k, device="cuda", generator=gen)[:8]] *= 100
        exact = x.double() @ w.double().t()
        row = {"data": data, "bf16": ((x.to(BF16) @ w.to(BF16).t()).double() - exact).norm().item() / exact.norm().item()}
        for gran, group in GRANULARITIES.items():
            qa, sa = operands(x.to(BF16), group)
            qb, sb = operands(w.to(BF16), group)
            y = fp8_gemm(qa, qb, sa, sb, group_k=group, out_dtype=torch.float32)
            row[gran] = ((y.double() - exact).norm() / exact.norm()).item()
        print(row, flush=True)
        out.append(row)
    return out


def outlier_rows() -> list[dict]:
    """Emulated numerics (gemctl.precision.fp8_linear.qdq: the kernels' quantization bit for bit;
    float64 products), on the GPU or the CPU: relative error of y = x W^T, and of x's small
    features after quantization (and, with a rotation, rotating back), per format, for x
    [2048, 2048] with 8 features scaled by 1 (none) to 10^5. Formats: row, block128, mx32, and
    row after a Hadamard rotation of 32 or 128 features (precision.fp8.hadamard)."""
    from gemctl.precision.fp8_linear import hadamard_features
    from gemctl.precision.mx_linear import _hadamard_cpu

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    m, k, n = 2048, 2048, 1024
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device)
    formats = {"row": (0, 0), "block128": (128, 0), "mx32": (32, 0), "row + hadamard 32": (0, 32),
               "row + hadamard 128": (0, 128)}
    out = _Rows()
    for scale in (1.0, 1e2, 1e3, 1e4, 1e5):
        x = torch.randn(m, k, generator=gen)
        outliers = torch.randperm(k, generator=gen)[:8]
        x[:, outliers] *= scale
        x = x.to(device)
        small = torch.ones(k, dtype=torch.bool, device=device)
        small[outliers.to(device)] = False
        exact = x.double() @ w.double().t()

        def rel(a, b):
            return ((a.double() - b.double()).norm() / b.double().norm()).item()

        row = {"outlier_scale": scale, "bf16": {"y": rel(x.to(BF16).double() @ w.to(BF16).double().t(), exact),
                                                "small": rel(x.to(BF16)[:, small], x[:, small])}}
        for name, (group, size) in formats.items():
            xr, wr = (hadamard_features(x, size), hadamard_features(w, size)) if size else (x, w)
            xq, wq = qdq(xr, group, 1), qdq(wr, group, 1)
            back = xq
            if size:  # R^-1 = R^T, block by block
                r = _hadamard_cpu(size, 0).to(device)
                back = (xq.reshape(m, k // size, size) @ r.t()).reshape(m, k)
            row[name] = {"y": rel(xq.double() @ wq.double().t(), exact), "small": rel(back[:, small], x[:, small])}
        print(row, flush=True)
        out.append(row)
    return out


def accumulation_rows() -> list[dict]:
    """Error of the FP32-vs-tensor-core accumulation alone: the same E4M3 operands, our GEMM and
    cuBLAS ``_scaled_mm`` (fast accumulation on and off) against float64 products of the
    dequantized operands, for contraction lengths of the MLP's GEMMs (the wgrad sums 65536
    tokens). Compare with the quantization error itself (~3.8% relative, section accuracy)."""
    out = _Rows()
    gen = torch.Generator(device="cuda").manual_seed(1)
    for k in (1024, 4096, 16384, 65536):
        a = torch.randn(512, k, device="cuda", generator=gen).to(BF16)
        b = torch.randn(512, k, device="cuda", generator=gen).to(BF16)
        qa, sa = operands(a, 0)
        qb, sb = operands(b, 0)
        fa = 2.0 ** (sa.float() - 127)
        fb = 2.0 ** (sb.float() - 127)
        exact = (qa.double() * fa.double()[:, None]) @ (qb.double() * fb.double()[:, None]).t()
        row = {"k": k}

        def err(c):
            return ((c.double() - exact).norm() / exact.norm()).item()

        row["ours, one tensor-core sum"] = err(fp8_gemm(qa, qb, sa, sb, out_dtype=torch.float32, promote_every=None))
        row["ours, FP32 every 4096 (default)"] = err(fp8_gemm(qa, qb, sa, sb, out_dtype=torch.float32))
        for fast in (True, False):
            c = torch._scaled_mm(qa, qb.t(), fa[:, None].contiguous(), fb[None, :].contiguous(),
                                 out_dtype=torch.float32, use_fast_accum=fast)
            row[f"cublas fast_accum={fast}"] = err(c)
        row["bf16 GEMM of the same values"] = err((qa.to(BF16) @ qb.to(BF16).t()).double() * fa.double()[:, None] * fb.double()[None, :])
        print(row, flush=True)
        out.append(row)
    return out


def profile_rows(tokens: int, widths=None) -> list[dict]:
    """Where the fused FP8 MLP's forward+backward time goes: CUDA time per kernel (torch.profiler,
    5 steps after 3 warm-up steps), per width; then the torch ops that launched device work, with
    their input shapes (which op a non-Triton kernel, e.g. an elementwise copy, comes from)."""
    out = _Rows()
    for d, h in MLP_WIDTHS:
        if widths and d not in widths:
            continue
        variants, params = mlp_variants(d, h)
        fn = variants["fp8 row fused+norm"]
        x = torch.randn(tokens, d, device="cuda", dtype=BF16, requires_grad=True)
        gy = torch.randn(tokens, d, device="cuda", dtype=BF16)

        def step():  # as the timed step: gradients set to None first, so no accumulation kernels
            for t in (x, *params):
                t.grad = None
            fn(x).backward(gy)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        for e in sorted(kernels, key=lambda e: -e.device_time_total)[:12]:
            out.append({"d": d, "kernel": e.key[:80], "calls_per_step": e.count / 5,
                        "ms_per_step": e.device_time_total / 5 / 1e3})
            print(out[-1], flush=True)
        ops = [e for e in prof.key_averages(group_by_input_shape=True)
               if e.key.startswith("aten::") and e.self_device_time_total > 0]
        for e in sorted(ops, key=lambda e: -e.self_device_time_total)[:8]:
            out.append({"d": d, "torch_op": e.key, "input_shapes": str(e.input_shapes)[:160],
                        "calls_per_step": e.count / 5, "ms_per_step": e.self_device_time_total / 5 / 1e3})
            print(out[-1], flush=True)
        del x, gy, variants, params
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_fp8.json")
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--only", default="accuracy,accumulation,cast,gemm,mlp,profile")
    ap.add_argument("--grans", default=",".join(GRANULARITIES), help="granularities timed in the gemm section")
    ap.add_argument("--mlp", default="", help="comma-separated MLP variants to time (default: all)")
    ap.add_argument("--widths", default="",
                    help="comma-separated model widths d of the gemm, mlp and profile sections (default: all)")
    ap.add_argument("--cast-widths", default="1024,4096,8192", help="comma-separated row widths of the cast section")
    ap.add_argument("--cast-amax-sweep", action="store_true",
                    help="cast section: the SiLU and RMSNorm casts with column maxima, and the column casts from "
                         "them, at every run length (16, 32, 64, 128 rows per column byte)")
    ap.add_argument("--cast-set", choices=("all", "mlp", "block"), default="all",
                    help="cast section: every cast; the six the fused MLP block runs (the issue's bar); or only "
                         "those it runs at each width of the mlp shapes (the RMSNorm and plain pairs at d, the SiLU "
                         "and plain pairs at 4d)")
    ap.add_argument("--pending", action="store_true",
                    help="autotune the cast and GEMM configs the GPU tier has not passed yet too (fp8_gemm._GPU_CHECKED)")
    args = ap.parse_args()

    def int_list(flag: str, text: str) -> list[int]:
        try:
            return [int(w) for w in text.split(",") if w]
        except ValueError:
            ap.error(f"{flag} {text}: comma-separated integers expected")  # one line, exit code 2

    # the arguments checked before any GPU work (the sections read meta only when they run)
    widths = int_list("--widths", args.widths)
    cast_widths = int_list("--cast-widths", args.cast_widths)
    if "cast" in args.only.split(",") and any(w > 8192 for w in cast_widths):  # fp8_rmsnorm_cast_rows' limit
        ap.error(f"--cast-widths {args.cast_widths}: the cast section takes rows of at most 8192 values")
    if "cast" in args.only.split(",") and args.cast_set == "block" and not all(block_roles(w) for w in cast_widths):
        allowed = ", ".join(str(w) for shape in MLP_WIDTHS for w in shape)
        ap.error(f"--cast-widths {args.cast_widths}: --cast-set block takes the widths of the mlp shapes ({allowed})")
    sections = {"accuracy": accuracy_rows, "outliers": outlier_rows, "accumulation": accumulation_rows,
                "cast": lambda: cast_rows(args.tokens, meta["copy_tbps"], cast_widths, args.cast_amax_sweep,
                                          args.cast_set),
                "gemm": lambda: gemm_rows(args.tokens, args.grans.split(","), widths),
                "mlp": lambda: mlp_rows(args.tokens, [v for v in args.mlp.split(",") if v], widths),
                "profile": lambda: profile_rows(args.tokens, widths)}
    parts = args.only.split(",")
    unknown = [p for p in parts if p not in sections]
    if unknown:
        ap.error(f"--only {','.join(unknown)}: unknown; allowed: {', '.join(sections)}")
    if not torch.cuda.is_available():
        if parts != ["outliers"]:
            raise SystemExit("bench_fp8: needs a CUDA GPU (only --only outliers, emulated numerics, runs on a CPU)")
        meta = {**base_meta(), "device": "cpu"}
    else:
        meta = run_meta(tokens=args.tokens)
    if args.pending:
        from gemctl.ops.triton import fp8_gemm

        fp8_gemm._PENDING_AUTOTUNE = True
    meta["pending_autotune"] = args.pending
    result = {"meta": meta}
    path = Path(args.out)
    global _ON_ROW

    def write(part: str, rows: list) -> None:  # partial results survive a timeout
        result[part] = rows
        result["configs"] = picked_configs(("fp8_cast_rows", "fp8_cast_cols", "fp8_gemm"))  # what was timed
        result["tuning_s"] = tuning_seconds()  # autotuning so far, its compiles included
        path.write_text(json.dumps(result, indent=1))

    for part in parts:  # in the order given
        _ON_ROW = lambda rows, part=part: write(part, rows)  # noqa: E731
        write(part, sections[part]())
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
