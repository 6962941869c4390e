"""Run a benchmark script with its CUDA work held to fewer streaming multiprocessors.

    python3 scripts/sm_limit.py --sms 94 scripts/bench_block_attention.py --sweep --only self-1000
    python3 scripts/sm_limit.py --h200 scripts/bench_gdpa.py --grid-only --only cross-128

A CUDA green context holds the process to N SMs of the GPU, and the persistent kernels size their
grids to the N (gemctl.ops.triton.common._sm_count); the benchmarks' result files record N
(bench_common.base_meta, `sm_limit`).

What for: the issues' bars are set on an H200, and the machines lent are mostly H100s. Both have
132 SMs of the same design and clocks; the H200 feeds them 4.25 TB/s (measured copy,
docs/benchmarks.md), the H100 3.0. An H100 held to 94 SMs has about the H200's copy bandwidth per
SM and its bytes per FLOP, so a memory-bound kernel that is short of bytes in flight per SM (the
block-attention backward, 1.5-2.5 points further from its roofline on the H200 than on an H100)
meets the same per-SM demand as on the H200. `--h200` picks N that way: SMs x the copy
bandwidth measured here / 4.25 TB/s. It is a proxy for developing on an H100, checked against runs
of the same tree on an H200 before it is trusted; a bar is judged on the card it names.

Refused with one line and exit code 2: no CUDA GPU, a torch without CUDA green contexts, an N out
of range, a script that does not exist, or a green context the work escapes (the SMs the check
kernel reaches from the current stream, a new stream and a CUDA graph replay must be within N).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

H200_COPY_TBPS = 4.25  # the H200's measured copy bandwidth (bench_block_attention / bench_gdpa runs)


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
    ap.add_argument("script", help="the Python script to run (its arguments follow)")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if not Path(args.script).is_file():
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
    try:
        green = green_contexts.GreenContext.create(num_sms=n, device_id=device)
    except Exception as exc:  # noqa: BLE001  (the driver's refusal, in one line)
        _fail(f"no green context of {n} SMs: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    _enter(green)
    seen = sms_reached(device)
    # the driver may round N up to its SM granularity: the SMs reached from the current stream are
    # the limit, and the other two launches must stay within them
    limit = seen["current stream"]
    if n < total and (limit >= total or any(v > limit for v in seen.values())):
        _fail(f"the work escapes the green context of {n} SMs (SMs reached: {seen})")
    os.environ["GEMCTL_SM_LIMIT"] = str(limit)
    from gemctl.ops.triton import common

    common._sm_count = lambda _device: limit  # the persistent grids: one wave on the SMs held
    how = f"--sms {n}" if copy_all is None else f"{n} of {total} SMs: copy {copy_all:.2f} TB/s on all / {args.like_tbps} TB/s"
    print(f"sm_limit: {torch.cuda.get_device_name(device)}, {limit} of {total} SMs ({how}); SMs reached: {seen}",
          flush=True)
    sys.argv = [args.script, *args.args]
    sys.path.insert(0, str(Path(args.script).resolve().parent))
    runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main()
