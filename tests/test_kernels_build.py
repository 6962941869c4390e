"""The Triton kernels compile for Hopper (sm_90) on a machine without a GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_kernels_build.py"), "--arch", "90"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ": ok" in ln]
    # jagged attention (16: dK/dV in both formulations; + the windowed forward, + the three passes
    # with the bias as tiles (dK/dV in both formulations), + delta, + 6 with the unmasked tiles by TMA
    # (one with lazy rescaling, one with the bias as tiles), + 3 with MXFP8 probabilities) + gdpa (12, + the forward
    # with whole key tiles by TMA) + block attention (8, + forward and backward in (BS, D/2) halves, +
    # the forward rotating in bf16x2, full and half width, + the half-width forward and backward
    # reading work records, + forward and backward with whole blocks by TMA) + MX quantize (5 by rows, 5 down the columns) and RMSNorm->MX (2) + FP8 GEMMs (6: row-wise, silu' epilogue, promoted,
    # token chunks, 128, 32) and the FP8 casts (23: rows one sweep, with column bytes, with two blocks
    # in flight, pipelined by Triton (silu, RMSNorm fused), by atomic max, a row per warp (Gluon:
    # silu, RMSNorm fused; and each with the shared-memory ring), two sweeps, RMSNorm fused, RMSNorm
    # fused with a bf16 weight; columns, from column bytes, pipelined, 4 programs per chunk, RMSNorm
    # recomputed; whole tiles unmasked, plain and RMSNorm recomputed, the
    # latter also in 8 warps under the register cap; the transpose in registers (Gluon), plain and
    # silu) + the RMSNorm backward (1) + the persistent TMA GEMM (2: silu'
    # epilogue, token-chunk scales) + the Gluon GDPA forward for Hopper (4: 128 keys with and without
    # the look-ahead K/V loads, 32 keys at head_dim 64 with SiLU and with GELU unfolded) and its two
    # timing probes (memory alone, math alone), those of its warp-specialized pick too (2) + its
    # warp-specialized forms (3 resident: 128 keys with
    # 4 query slots and 2 K/V buffers, with 6 and 1, 32 keys at head_dim 64 with SiLU; 3 streaming:
    # 64-key tiles in 4 stages, 128 in 2, 32 at head_dim 64 with SiLU) + the Gluon block
    # attention backward and forward for Hopper (3 each: D=128 with fp16 rope tables and without
    # rope, D=64 with fp32 tables; the backward also paired, D=128 with fp16 tables)
    assert len(lines) == 16 + 6 + 6 + 3 + 13 + 16 + 12 + 6 + 23 + 1 + 2 + 4 + 2 + 2 + 3 + 3 + 7, proc.stdout
    # the FP8 column casts at a jagged token count (not a multiple of 16) keep 16-byte vector stores
    stores = [ln for ln in proc.stdout.splitlines() if "jagged R:" in ln]
    assert len(stores) == 5 and all(ln.endswith(": vector") for ln in stores), proc.stdout  # + pipelined, whole tiles
    # a size that changes with every batch never changes a kernel's specialization (no compile
    # mid-training when a jagged token count happens to be a multiple of 16)
    specs = [ln for ln in proc.stdout.splitlines() if " per-batch " in ln]
    assert len(specs) == 14 and all(ln.endswith(": stable") for ln in specs), proc.stdout


def test_programs_per_sm_match_the_h200_profiles():
    """--ptxas's occupancy against Nsight Compute's block limits on the H200 (registers, shared
    memory) for kernels profiled there (docs/runs/*ncu*), and the rules' edges."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from check_kernels_build import programs_per_sm

    both = "registers and shared memory"
    # 2026-12-01_ncu_block_self1000_d714d25.txt: block attention backward (4, 1, 1, 0, 1), forward (4, 2, 0, 0, 1)
    assert programs_per_sm(168, 4, 65536) == (3, both)
    assert programs_per_sm(202, 4, 81920) == (2, both)
    # 2026-11-30_ncu_gdpa_cross128_pinned_b0d749e.txt: GDPA forward 64x32 (3, 3); dK/dV and dQ at 255 registers (2)
    assert programs_per_sm(153, 4, 65536) == (3, both)
    assert programs_per_sm(255, 4, 0)[0] == 2
    # the rules: 177 registers round up to 184 a thread; the four 16,384-register sub-partitions
    # (81 registers at 2 warps: 5 warps a sub-partition, 10 programs, not 65536 // 5,632 = 11);
    # shared memory in 128-byte units; no registers (no limit from them); a kernel that does not fit
    assert programs_per_sm(177, 4, 65536) == (2, "registers")
    assert programs_per_sm(81, 2, 0) == (10, "registers")
    assert programs_per_sm(40, 4, 57345) == (3, "shared memory") and programs_per_sm(40, 4, 57344)[0] == 4
    assert programs_per_sm(0, 1, 0) == (32, "blocks")
    assert programs_per_sm(255, 16, 0) == (0, "registers")


def test_compile_time_is_counted_outside_tuning(monkeypatch):
    """Triton's compile hooks time each compile; compiles while pick_config tunes are tuning time
    already; a hook installed before ours still runs, and its answer (skip the compile) stands
    without leaving a start time behind."""
    import time
    import types

    import triton

    from gemctl.ops.triton import common

    runtime = triton.knobs.runtime
    monkeypatch.setattr(common, "_compile_t0", {})
    seen = []
    monkeypatch.setattr(runtime, "jit_cache_hook", lambda *a, **k: seen.append("before") or "skip")
    monkeypatch.setattr(runtime, "jit_post_compile_hook", lambda *a, **k: seen.append("after"))
    monkeypatch.setattr(common, "_compile_s", 0.0)
    common._install_compile_hooks()
    assert runtime.jit_cache_hook(key="k") == "skip"  # skipped: no post-compile call follows
    assert seen == ["before"] and not common._compile_t0
    monkeypatch.setattr(runtime, "jit_cache_hook", None)
    monkeypatch.setattr(runtime, "jit_post_compile_hook", lambda *a, **k: seen.append("after"))
    common._install_compile_hooks()
    assert not runtime.jit_cache_hook(key="k")
    time.sleep(0.05)
    runtime.jit_post_compile_hook(key="k")
    assert seen == ["before", "after"] and 0.04 < common.compile_seconds() < 1.0
    counted = common.compile_seconds()
    monkeypatch.setattr(common, "_tuning_now", True)
    runtime.jit_cache_hook(key="k")
    time.sleep(0.02)
    runtime.jit_post_compile_hook(key="k")
    assert common.compile_seconds() == counted  # inside tuning: not counted twice
    assert common.setup_seconds() == common.tuning_seconds() + counted
    monkeypatch.setattr(common, "_tuning_now", False)
    # paired by kernel and key: a compile that raised leaves its start, and neither a finish of
    # another key nor a finish without a start picks it up
    fn_a, fn_b = types.SimpleNamespace(jit_function=object()), types.SimpleNamespace(jit_function=object())
    runtime.jit_cache_hook(key=("a",), fn=fn_a)  # raised: no post-compile call
    time.sleep(0.05)
    runtime.jit_post_compile_hook(key=("a",), fn=fn_b)  # another kernel's finish, never started
    runtime.jit_cache_hook(key=("b",), fn=fn_a)
    runtime.jit_post_compile_hook(key=("b",), fn=fn_a)
    assert common.compile_seconds() - counted < 0.01
    runtime.jit_cache_hook(key=("a",), fn=fn_a)  # compiled again: the new start replaces the old
    runtime.jit_post_compile_hook(key=("a",), fn=fn_a)
    assert common.compile_seconds() - counted < 0.01 and not common._compile_t0


@pytest.mark.gpu
def test_a_real_compile_is_timed_by_the_hooks():
    """Triton itself calls the hooks (the kwargs they pair by included): a kernel compiled for a
    constexpr value no run has used adds its compile time, its second launch adds nothing."""
    import time

    import torch
    import triton
    import triton.language as tl

    from gemctl.ops.triton import common

    @triton.jit
    def _fill(X, VALUE: tl.constexpr):
        tl.store(X + tl.arange(0, 16), tl.full((16,), VALUE, tl.float32))

    x = torch.empty(16, device="cuda")
    value = float(time.time_ns() % 100_000)  # a specialization no earlier run compiled
    before, pending = common.compile_seconds(), dict(common._compile_t0)
    _fill[(1,)](x, VALUE=value)
    torch.cuda.synchronize()
    compiled = common.compile_seconds()
    assert compiled > before and common._compile_t0 == pending  # its start paired with its finish
    _fill[(1,)](x, VALUE=value)
    torch.cuda.synchronize()
    assert common.compile_seconds() == compiled and torch.all(x == value)


def _fake_pick(monkeypatch, workers: str, preload_fails: bool = False):
    """pick_config on a machine without a GPU as it runs on one: our compile hooks installed, a
    kernel whose launches ask Triton's jit_cache_hook first (as JITFunction._do_compile does: a
    true answer skips the compile, and Triton then launches nothing), timing by a stand-in."""
    import threading
    import types

    import triton
    from triton.runtime import _async_compile

    from gemctl.ops.triton import common

    runtime = triton.knobs.runtime
    monkeypatch.setattr(runtime, "jit_cache_hook", None)
    monkeypatch.setattr(runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(common, "_hooks", False)
    common._install_compile_hooks()
    monkeypatch.setattr(common, "INTERPRET", False)
    monkeypatch.setattr(common, "_config_cache", {})
    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(common.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(common, "_time", lambda fn: (fn(), 1.0)[1])
    monkeypatch.setenv("GEMCTL_AUTOTUNE_CACHE", "0")
    monkeypatch.setenv("GEMCTL_AUTOTUNE", "1")
    monkeypatch.setenv("GEMCTL_COMPILE_WORKERS", workers)
    seen = types.SimpleNamespace(preloads=[], launches=[], events=[], built=set())

    class Kernel:
        def preload(self, data):
            if preload_fails and data.endswith("64"):
                raise RuntimeError("not reproducible from its data")
            mode = _async_compile.active_mode.get()
            seen.preloads.append((data, mode is not None, threading.current_thread() is threading.main_thread()))
            seen.events.append(("preload", data))
            seen.built.add(data)

    kernel = types.SimpleNamespace(jit_function=Kernel())

    def run(cfg):
        # each config launches its tile kernel and a shared epilogue kernel
        for data in (f"tile{cfg[0]}", "epilogue"):
            if data not in seen.built:  # Triton asks the hook only for a kernel not built yet
                if runtime.jit_cache_hook(key=data, fn=kernel, compile={"specialization_data": data}):
                    continue
                seen.built.add(data)  # compiled at the launch
                seen.events.append(("compile", data))
                runtime.jit_post_compile_hook(key=data, fn=kernel)
            seen.launches.append((cfg, data))
            seen.events.append(("launch", data))

    return common, run, seen


def test_candidates_compile_in_parallel_before_timing(monkeypatch):
    """A key's candidates are launched once with the compiles collected and skipped (nothing runs),
    each distinct compile is handed to Triton's preload once under AsyncCompileMode (its thread
    pool compiles them), and only then is each candidate timed, launching as usual."""
    common, run, seen = _fake_pick(monkeypatch, "4")
    candidates = [(16,), (32,), (64,)]
    assert common.pick_config(("fake", 1), candidates, run) == (16,)  # all tie: the first
    assert sorted(d for d, _, _ in seen.preloads) == ["epilogue", "tile16", "tile32", "tile64"]
    assert all(async_mode for _, async_mode, _ in seen.preloads)
    # every compile is the pool's, done before the first timed launch; none at a launch
    assert [e for e, _ in seen.events[:4]] == ["preload"] * 4 and ("compile", "tile16") not in seen.events
    # nothing launched while collecting: the launches are the timing loop's and the finals'
    assert [cfg for cfg, data in seen.launches if data != "epilogue"][:3] == candidates
    assert len(seen.launches) == 2 * (3 + 3 * common.FINAL_ROUNDS)
    assert common._collecting.requests is None and common.pick_config(("fake", 1), candidates, run) == (16,)


def test_precompile_off_and_its_failures(monkeypatch):
    """GEMCTL_COMPILE_WORKERS=1 compiles as the candidates are timed; a compile preload cannot
    make is left to the timing loop; a kernel still to be tuned inside a collecting launch is not
    tuned from launches that run nothing; a bad worker count is one line naming the variable."""
    from gemctl.errors import UserError

    common, run, seen = _fake_pick(monkeypatch, "1")
    assert common.pick_config(("fake", 2), [(16,), (32,)], run) == (16,)
    assert not seen.preloads and len(seen.launches) == 2 * (2 + 2 * common.FINAL_ROUNDS)

    common, run, seen = _fake_pick(monkeypatch, "3", preload_fails=True)
    assert common.pick_config(("fake", 3), [(16,), (64,)], run) == (16,)
    assert sorted(d for d, _, _ in seen.preloads) == ["epilogue", "tile16"]
    assert ("compile", "tile64") in seen.events and ((64,), "tile64") in seen.launches  # built at its timed launch
    assert ("compile", "tile16") not in seen.events

    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime._async_compile import AsyncCompileMode

    common, run, seen = _fake_pick(monkeypatch, "3")
    with ThreadPoolExecutor(1) as pool, AsyncCompileMode(pool):  # another caller's async compiles
        assert common.pick_config(("fake", 4), [(16,), (32,)], run) == (16,)
    assert not seen.preloads  # one mode at a time: compiled as timed

    from triton.runtime import _async_compile

    def exit_raising(self, *exc):  # as Triton 3.6's exit when a finalizer raises: the mode stays set
        raise RuntimeError("a post-compile hook failed")

    common, run, seen = _fake_pick(monkeypatch, "2")
    monkeypatch.setattr(AsyncCompileMode, "__exit__", exit_raising)
    assert common.pick_config(("fake", 5), [(16,), (32,)], run) == (16,)
    assert _async_compile.active_mode.get() is None  # later compiles are not sent to a closed pool
    monkeypatch.undo()

    nested_keys = []

    def outer(cfg):  # a launch that first needs another kernel's pick
        nested_keys.append(cfg)
        common.pick_config(("inner",), [(1,), (2,)], run)
        run(cfg)

    common, run, seen = _fake_pick(monkeypatch, "2")
    assert common.pick_config(("outer",), [(16,), (32,)], outer) == (16,)
    assert ("inner",) in common._config_cache and ("outer",) in common._config_cache
    # the inner pick was tuned by a real launch (its timing loop launched), not while collecting
    assert ((1,), "tile1") in seen.launches and ((2,), "tile2") in seen.launches

    monkeypatch.setenv("GEMCTL_COMPILE_WORKERS", "two")
    with pytest.raises(UserError, match="GEMCTL_COMPILE_WORKERS='two': expected a whole number"):
        common.compile_workers()
    monkeypatch.setenv("GEMCTL_COMPILE_WORKERS", "0")
    with pytest.raises(UserError):
        common.compile_workers()
    monkeypatch.delenv("GEMCTL_COMPILE_WORKERS")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
    assert common.compile_workers() == 1  # this rank's share of the cores


@pytest.mark.gpu
def test_precompiled_candidates_are_the_kernels_their_launches_build(monkeypatch):
    """Through Triton itself: a key's candidates compile once each in the thread pool (preload of
    the collected specialization data, under the cache entry a launch looks up), the timing loop
    compiles nothing more, and each candidate's kernel computes with its own constexprs."""
    import time

    import torch
    import triton
    import triton.language as tl

    from gemctl.ops.triton import common

    @triton.jit
    def _stamp(X, n, VALUE: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(X + offs, tl.full((BLOCK,), VALUE, tl.float32) + offs, mask=offs < n)

    runtime = triton.knobs.runtime
    compiled = []
    ours = runtime.jit_post_compile_hook
    monkeypatch.setattr(runtime, "jit_post_compile_hook", lambda *a, **k: compiled.append(k.get("key")) or
                        (ours(*a, **k) if ours else None))
    monkeypatch.setenv("GEMCTL_COMPILE_WORKERS", "4")
    monkeypatch.setenv("GEMCTL_AUTOTUNE", "1")
    monkeypatch.setenv("GEMCTL_AUTOTUNE_CACHE", "0")
    handed = []
    precompile = common._precompile
    monkeypatch.setattr(common, "_precompile",
                        lambda c, r: handed.append((precompile(c, r), len(compiled))) or handed[-1][0])
    value = float(time.time_ns() % 100_000)  # specializations no earlier run compiled
    x = torch.zeros(128, device="cuda")

    def run(cfg):
        _stamp[(1,)](x, 128, VALUE=value + cfg[0], BLOCK=cfg[0])

    candidates = [(16,), (32,), (64,), (128,)]
    assert common.pick_config(("stamp", value), candidates, run) in candidates
    assert handed == [(4, 4)] and len(compiled) == 4  # each compiled once, by the pool, before any timing
    for (block,) in candidates:
        x.zero_()
        run((block,))
        torch.cuda.synchronize()
        want = value + block + torch.arange(block, device="cuda", dtype=torch.float32)
        assert torch.equal(x[:block], want) and not x[block:].any()
    assert len(compiled) == 4
