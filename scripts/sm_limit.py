"""Run a benchmark script with its CUDA work held to fewer streaming multiprocessors.

    python3 scripts/sm_limit.py --sms 94 scripts/bench_block_attention.py --sweep --only self-1000
    python3 scripts/sm_limit.py --h200 scripts/bench_gdpa.py --grid-only --only cross-128

A CUDA green context holds the process to N SMs of the GPU, and the persistent kernels size their
grids to the N (gemctl.ops.triton.common._sm_count); the benchmarks' result files record N
(bench_common.base_meta: `sm_limit`, and the GPU named "held to N SMs").

What for: the issues' bars are set on an H200, and the machines lent are mostly H100s. Both have
132 SMs of the same design and clocks; the H200 feeds them 4.25 TB/s (measured copy,
docs/benchmarks.md), the H100 3.0. An H100 held to 94 SMs has about the H200's copy bandwidth per
SM and its bytes per FLOP, so a memory-bound kernel that is short of bytes in flight per SM (the
block-attention backward, 1.5-2.5 points further from its roofline on the H200 than on an H100)
meets the same per-SM demand as on the H200. `--h200` picks N that way: SMs x the copy
bandwidth measured here / 4.25 TB/s. It is a proxy for developing on an H100; a bar is judged on
the card it names.

Checked against the H200 (`gpu.sh proxy-check`, 2026-12-06, docs/benchmarks.md, block_attention):
held to 96 SMs, an H100 ranks the block backward's ring restructure ahead of its base as the H200
does (1.05x / 1.01x at self-1000 / self-4000) where the whole H100 ranks it behind (0.96x / 0.98x),
but the H200 gains 1.10x / 1.12x: the proxy keeps the direction of a change of 5% or more and a
third or less of its size. It does not show GDPA cross-128's H200 shortfall (80-82% of the roofline
held, 83-84% whole, 71% on the H200).

The driver rounds N up to its SM granularity (a multiple of 8 is assumed: 94 asked, 96 held); the
limit recorded and used is what a check kernel reaches from the current stream. It must lie between
N and N rounded up, and a new stream and a CUDA graph replay must reach no more. Tuned configs go to
a cache of their own (GEMCTL_CACHE_DIR/sm_limit_<N>): picks timed on the held SMs never reach a
whole-GPU run. The script runs as if launched directly (its directory first on sys.path, then its
tree's root, as the benchmarks put it): gpu.sh times other trees' scripts through this one, and
they import their own gemctl and bench_common (whose base_meta is wrapped to label the files when it
does not read GEMCTL_SM_LIMIT itself, as trees before it did not).

Refused with one line and exit code 2: no CUDA GPU, a torch without CUDA green contexts, an N out
of range, a script that does not exist or whose gemctl does not import, a green context that fails
or that the work escapes.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

H200_COPY_TBPS = 4.25  # the H200's measured copy bandwidth (bench_block_attention / bench_gdpa runs)
GRANULE = 8  # SMs: the green contexts' granularity assumed on sm_90 (N is rounded up to a multiple)


def _fail(message: str) -> None:
    print(f"sm_limit: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 usage="sm_limit.py (--sms N | --h200 | --like-tbps TBPS) SCRIPT [ARGS...]")
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--sms", type=int, help="hold the work to N SMs")
    group.add_argument("--h200", action="store_const", const=H200_COPY_TBPS, dest="like_tbps",
                       help=f"N = SMs x copy bandwidth here / {H200_COPY_TBPS} TB/s (an H200's bandwidth per SM)")
    group.add_argument("--like-tbps", type=float, help="N = SMs x copy bandwidth here / TBPS (a GPU of the same "
                       "SM count with TBPS of copy bandwidth)")
    ap.add_argument("--resolve", action="store_true", help="print the number of SMs asked for and exit (no green "
                    "context: gpu.sh resolves --h200 once, so every run of an A/B holds the same SMs)")
    ap.add_argument("script", nargs="?", help="the Python script to run (its arguments follow)")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if args.script is None and not args.resolve:
        _fail("a script to run is needed (or --resolve)")
    if args.script is not None and not Path(args.script).is_file():
        _fail(f"no script at {args.script!r}")
    if args.sms is not None and args.sms < 1:
        _fail(f"--sms must be a positive number of SMs, got {args.sms}")
    if args.like_tbps is not None and not args.like_tbps > 0:
        _fail(f"--like-tbps must be a positive bandwidth in TB/s, got {args.like_tbps}")
    return args


def sms_for(total_sms: int, copy_tbps: float, like_tbps: float) -> int:
    """The SMs that give this GPU (``total_sms``, ``copy_tbps``) the copy bandwidth per SM of one with
    the same SM count and ``like_tbps``: all of them if that GPU has less bandwidth."""
    return max(1, min(total_sms, round(total_sms * copy_tbps / like_tbps)))


def _smid_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def smid(out, spin):
        pid = tl.program_id(0)
        acc = pid
        for i in range(spin):  # a few microseconds per program, so the grid spreads over every SM it may use
            acc = (acc * 1103515245 + i) & 0x7FFFFFFF
        s = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [acc], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(out + pid, s)

    return smid


def sms_reached(device) -> dict[str, int]:
    """How many distinct SMs a 4096-program grid reaches from the current stream, a new stream and a
    CUDA graph replayed on it."""
    import torch

    kernel = _smid_kernel()
    seen = {}
    out = torch.empty(4096, dtype=torch.int32, device=device)

    def launch():
        kernel[(out.numel(),)](out, 2000)

    launch()
    torch.cuda.synchronize()
    seen["current stream"] = int(out.unique().numel())
    stream = torch.cuda.Stream(device=device)
    with torch.cuda.stream(stream):
        out.zero_()
        launch()
    torch.cuda.synchronize()
    seen["new stream"] = int(out.unique().numel())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            launch()
        out.zero_()
        graph.replay()
    torch.cuda.synchronize()
    seen["graph replay"] = int(out.unique().numel())
    return seen


def _copy_tbps() -> float:
    """Copy bandwidth of the whole GPU (TB/s, read + write, a 1 GiB bf16 tensor), as bench_common
    measures it; not imported from there, so that the script run next imports the bench_common of
    its own tree (sm_limit.py may time another tree's benchmarks)."""
    import torch
    import triton.testing

    x = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
    del x, y
    torch.cuda.empty_cache()
    return 2 * 2**29 * 2 / (ms * 1e-3) / 1e12


def _enter(green) -> None:
    """Make the green context current (set_context in newer torch, make_current in older)."""
    for name in ("set_context", "make_current"):
        if hasattr(green, name):
            getattr(green, name)()
            return
    _fail("this torch's GreenContext has neither set_context nor make_current")


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    import torch

    if not torch.cuda.is_available():
        _fail("needs a CUDA GPU")
    from torch.cuda import green_contexts

    supported = getattr(green_contexts, "SUPPORTED", None)  # absent in the first torch releases that had them
    if supported is None:
        supported = hasattr(torch._C, "GreenContext") or hasattr(torch._C, "_CUDAGreenContext")
    if not supported:
        _fail(f"torch {torch.__version__} has no CUDA green contexts (a CUDA 12.8+ build and driver are needed)")
    device = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(device).multi_processor_count
    copy_all = None
    if args.like_tbps is not None:
        copy_all = _copy_tbps()
        n = sms_for(total, copy_all, args.like_tbps)
    else:
        n = args.sms
        if n > total:
            _fail(f"--sms must be at most the GPU's {total} SMs, got {n}")
    if args.resolve:
        print(n)
        return
    try:
        green = green_contexts.GreenContext.create(num_sms=n, device_id=device)
        _enter(green)
        seen = sms_reached(device)
    except Exception as exc:  # noqa: BLE001  (the driver's refusal or a failed check, in one line)
        _fail(f"no green context of {n} SMs: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    # the SMs reached from the current stream are the limit: N, or N rounded up to the driver's SM
    # granularity (a multiple of 8 assumed); the other two launches must stay within them
    limit = seen["current stream"]
    rounded = min(total, -(-n // GRANULE) * GRANULE)
    if n < total and (not n <= limit <= rounded or any(v > limit for v in seen.values())):
        _fail(f"the green context of {n} SMs does not hold the work to {n}-{rounded} SMs (SMs reached: {seen})")
    asked = f"--sms {n}" if copy_all is None else f"asked {n}: copy {copy_all:.2f} TB/s on all / {args.like_tbps} TB/s"
    _run_held(args, limit, f"{torch.cuda.get_device_name(device)}, {limit} of {total} SMs ({asked}); SMs reached: {seen}")


def _run_held(args, limit: int, line: str) -> None:
    """Run the script as if launched directly (sys.argv, sys.path[0] its directory), its tree's
    kernels sized to ``limit`` SMs, tuned configs kept apart from whole-GPU ones, its result files
    labelled."""
    script = Path(args.script).resolve()
    root = script.parents[1] if script.parent.name == "scripts" else script.parent
    # the target's tree first, as its own sys.path lines would put it, before gemctl is imported
    # here: gpu.sh times other trees with this script, and those must import their own modules
    sys.path[0] = str(script.parent)
    sys.path.insert(1, str(root))
    os.environ["GEMCTL_SM_LIMIT"] = str(limit)
    cache = Path(os.environ.get("GEMCTL_CACHE_DIR") or Path.home() / ".cache" / "gemctl")
    os.environ["GEMCTL_CACHE_DIR"] = str(cache / f"sm_limit_{limit}")  # picks timed on these SMs only
    try:
        from gemctl.ops.triton import common
    except ImportError as exc:
        _fail(f"cannot import gemctl for {args.script} ({exc}): run it from its tree or set PYTHONPATH")
    common._sm_count = lambda _device: limit  # the persistent grids: one wave on the SMs held
    _label_results(limit)
    print(f"sm_limit: {line}", flush=True)
    sys.argv = [args.script, *args.args]
    runpy.run_path(args.script, run_name="__main__")


def _label_results(limit: int) -> None:
    """The target tree's bench_common.base_meta made to name the limit (trees whose base_meta does
    not read GEMCTL_SM_LIMIT): every result file then says the GPU was held. No bench_common there:
    nothing to label."""
    try:
        import bench_common
    except ImportError:
        return
    base_meta = bench_common.base_meta

    def labelled(**extra):
        meta = base_meta(**extra)
        if "sm_limit" not in meta:
            meta["sm_limit"] = limit
            meta["gpu"] = f"{meta.get('gpu', '?')} held to {limit} SMs (sm_limit.py)"
        return meta

    bench_common.base_meta = labelled


if __name__ == "__main__":
    main()
