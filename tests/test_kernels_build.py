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
