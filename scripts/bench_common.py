"""Pieces shared by the kernel benchmarks: the timer, the copy-bandwidth ceiling and the run's
metadata (GPU, versions, date), so every table states the same things the same way."""

from __future__ import annotations

import os
import sys
import time

import torch
import triton
import triton.testing

from gemctl.metrics.provenance import source_commit


def bench(fn, grad_to_none=None, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` over ~``rep`` ms of repeats (launch overhead included)."""
    return triton.testing.do_bench(fn, warmup=25, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def graph_bench(fn, rep: int = 100, nan_on_failure: bool = False) -> float:
    """Median milliseconds of ``fn`` by CUDA-graph replay: GPU time without the host launch cost
    (which bounds eager calls of short kernels). Where ``fn`` cannot be captured: raises, or with
    ``nan_on_failure`` says so and returns NaN (callers that keep their eager timing then)."""
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    except Exception as exc:  # noqa: BLE001
        if not nan_on_failure:
            raise
        torch.cuda.synchronize()
        print(f"  (CUDA graph capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]})", flush=True)
        return float("nan")


# The first element of each Triton kernel's autotune key (gemctl.ops.triton.common.pick_config):
# the names --pin takes.
PINNABLE = ("fwd", "dkdv", "dq", "gdpa_fwd", "gdpa_dkdv", "gdpa_dq", "block_attention_fwd", "block_attention_bwd")


def add_pin_argument(ap) -> None:
    ap.add_argument("--pin", action="append", default=[], metavar="KERNEL=CFG",
                    help="with --profile-step: run KERNEL with config CFG (comma-separated integers) instead of "
                    f"autotuning it; KERNEL is one of {', '.join(PINNABLE)}. Autotuning inside an ncu process times "
                    "the candidates under the profiler's launch interception and can pick another config than the "
                    "benchmark did (repeatable)")


def add_configs_argument(ap, flag: str, help: str) -> None:
    """A list of kernel configs for ``flag``: as separate arguments or in one quoted string, both split
    on spaces (``--grid-configs 64,32,4,2 64,128,4,4`` and ``--grid-configs "64,32,4,2 64,128,4,4"``
    are one list); parse_configs reads it."""
    ap.add_argument(flag, nargs="*", default=[], metavar="CFG", help=help)


def parse_configs(flag: str, items: list[str]) -> list[tuple[int, ...]]:
    """The configs add_configs_argument's ``flag`` received, each comma-separated integers; a
    malformed one prints one line naming the flag and the config, exit code 2."""
    configs = []
    for item in " ".join(items).split():
        try:
            configs.append(tuple(int(x) for x in item.split(",")))
        except ValueError:
            _refuse(f"{flag}: {item!r} is not a config (comma-separated integers, e.g. 64,32,4,2,0,0)")
    return configs


def _refuse(msg: str):
    """A bad command line: one line on stderr, exit code 2."""
    print(msg, file=sys.stderr)
    raise SystemExit(2)


def parse_pins(items: list[str], profiling: bool) -> dict:
    """``["gdpa_fwd=64,32,4,3,0,0", ...]`` -> {"gdpa_fwd": (64, 32, 4, 3, 0, 0)}. A malformed item,
    or pins without --profile-step, print one line and exit 2."""
    if items and not profiling:
        _refuse("--pin applies to --profile-step only (benchmarks time autotuned configs; the sweeps pin their own)")
    pins = {}
    for item in items:
        name, _, cfg = item.partition("=")
        try:
            values = tuple(int(x) for x in cfg.split(","))
        except ValueError:
            values = ()
        if name not in PINNABLE or not values:
            _refuse(f"--pin: expected KERNEL=INT,INT,... with KERNEL one of {', '.join(PINNABLE)}, got {item!r}")
        pins[name] = values
    return pins


def picked_configs(kernels: tuple[str, ...]) -> dict:
    """The configs autotuning picked so far for these kernels (the autotune key's first element),
    as {"kernel/key/fields": [config]}: what a benchmark's numbers were measured with."""
    from gemctl.ops.triton import common

    return {"/".join(map(str, key)): list(cfg) for key, cfg in common._config_cache.items() if str(key[0]) in kernels}


def profile_step(fn, warmup: int = 3, pins: dict | None = None) -> None:
    """For ``ncu --profile-from-start off``: ``fn`` ``warmup`` times (compilation, autotuning, plans),
    then once between CUDA profiler start and stop, so the counters cover one step only. ``pins``
    (kernel -> config, see parse_pins) replace autotuning for those kernels. Prints the config of
    every kernel the step ran, so the profile names the code it measured."""
    from gemctl.ops.triton import common

    with common.forced_config(pins or {}):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        used = {name.split("/")[0]: tuple(cfg) for name, cfg in picked_configs(PINNABLE).items()}
        used.update(pins or {})
        print("profiled configs:", " ".join(f"{name}={','.join(map(str, cfg))}" for name, cfg in sorted(used.items())),
              flush=True)
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def copy_tbps() -> float:
    """Device copy bandwidth (TB/s, read + write) of a 1 GiB bf16 tensor: the memory ceiling."""
    x = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return 2 * x.numel() * 2 / (bench(lambda: y.copy_(x)) * 1e-3) / 1e12


def base_meta(**extra) -> dict:
    """Date, GPU, torch and triton versions, the commit, the threads that compile autotuning's candidates,
    and ``extra``: what every result file records."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"
    from gemctl.ops.triton.common import compile_workers

    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": gpu, "torch": torch.__version__,
            "triton": triton.__version__, "commit": source_commit(), "compile_workers": compile_workers()}
    if os.environ.get("GEMCTL_SM_LIMIT"):  # under scripts/sm_limit.py: the GPU held to that many SMs, in its name too
        meta["sm_limit"] = int(os.environ["GEMCTL_SM_LIMIT"])
        meta["gpu"] = f"{gpu} held to {meta['sm_limit']} SMs (sm_limit.py)"
    return {**meta, **extra}


def run_meta(**extra) -> dict:
    """base_meta, and the copy ceiling measured now."""
    meta = {**base_meta(**extra), "copy_tbps": copy_tbps()}
    print(meta, flush=True)
    return meta
