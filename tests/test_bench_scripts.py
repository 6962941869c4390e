"""The kernel benchmarks' command line: --pin for --profile-step (what ncu measures); the host-cost
script on a CPU; the block-attention bench's bookkeeping with its timings stubbed; loss_compare on
skipped steps."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_common  # noqa: E402
from gemctl.ops.triton import common  # noqa: E402


def test_parse_pins():
    pins = bench_common.parse_pins(["gdpa_fwd=64,32,4,3,0,0", "dq=64,64,4,2"], profiling=True)
    assert pins == {"gdpa_fwd": (64, 32, 4, 3, 0, 0), "dq": (64, 64, 4, 2)}
    assert bench_common.parse_pins([], profiling=False) == {}


@pytest.mark.parametrize("items,profiling", [
    (["gdpa_fwd=64,32,4,3,0,0"], False),  # pins only make sense for the profiled step
    (["nonsense=1,2"], True),
    (["gdpa_fwd="], True),
    (["gdpa_fwd=64,x"], True),
    (["gdpa_fwd"], True),
])
def test_bad_pins_exit_2(items, profiling, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_common.parse_pins(items, profiling)
    assert exc.value.code == 2
    assert "--pin" in capsys.readouterr().err


def test_pinnable_names_are_the_kernels_autotune_keys():
    """Every name --pin accepts is the first element of some kernel's autotune key, so a pin reaches
    a kernel (forced_config matches on it) instead of being ignored."""
    sources = "".join(p.read_text() for p in (ROOT / "gemctl/ops/triton").glob("*.py"))
    for name in bench_common.PINNABLE:
        assert f'("{name}",' in sources, name
    with common.forced_config({"gdpa_fwd": (1, 2)}):
        assert common.pick_config(("gdpa_fwd", 128), [(3, 4)], lambda cfg: None) == (1, 2)


@pytest.mark.parametrize("script", ["bench_gdpa.py", "bench_jagged_attention.py", "bench_block_attention.py"])
def test_scripts_refuse_pins_without_profile_step(script):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--pin", "dq=64,64,4,2"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr[-500:]
    assert proc.stderr.strip().splitlines()[-1].startswith("--pin applies to --profile-step only")


def test_block_attention_profile_step_names_the_workloads_it_takes():
    """--profile-step takes the issue's workloads and their whole-block variants (what ncu compares to
    tell what the partial blocks cost); anything else is one line naming them, exit 2."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_block_attention.py"), "--profile-step",
                           "self-999"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr[-500:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("bench_block_attention: --profile-step takes one of ") and "'self-999'" in line
    assert "self-1000, self-1000-whole" in line and "self-4000-whole" in line


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_gdpa_bench_without_a_gpu_exits_2():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gdpa.py"), "--grid-only", "--only", "self-1000"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr[-500:]
    assert proc.stderr.strip().splitlines()[-1].startswith("bench_gdpa: needs a CUDA GPU")


def test_gdpa_probes_follow_each_gluon_config(monkeypatch):
    """--probes: each resident Gluon config (ninth field 1, or 2: warp-specialized) is followed by its
    two probes (eleventh field 1, 2); Triton configs, the streaming form and a probe given directly
    are not probed, and gdpa_hopper then lets probes run."""
    pytest.importorskip("triton.experimental.gluon")
    import bench_gdpa
    from gemctl.ops.triton import gdpa_hopper

    monkeypatch.setattr(gdpa_hopper, "PROBES", False)
    pick, triton_cfg, probe = (64, 128, 4, 2, 2, 16, 0, 0, 1, 1), (64, 32, 4, 2, 0, 0), (64, 128, 4, 2, 2, 16, 0, 0, 1, 0, 2)
    assert bench_gdpa.with_probes([pick, triton_cfg, probe]) == [pick, pick + (1,), pick + (2,), triton_cfg, probe]
    ws, stream = (64, 128, 4, 4, 1, 16, 0, 0, 2, 2), (64, 64, 4, 4, 1, 0, 0, 0, 3)
    assert bench_gdpa.with_probes([ws, stream]) == [ws, ws + (1,), ws + (2,), stream]
    assert gdpa_hopper.PROBES
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gdpa.py"), "--probes"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2 and "--probes: give it with --grid-only and --grid-configs" in proc.stderr


def test_config_lists_take_separate_arguments_or_one_quoted_list():
    """The benchmarks' config lists (--grid-configs, --fwd-configs, --bwd-configs) read the same from
    separate arguments and from one quoted string; a malformed config is one line naming the flag
    and the config, exit code 2, in both scripts."""
    import argparse

    import bench_common

    ap = argparse.ArgumentParser()
    bench_common.add_configs_argument(ap, "--grid-configs", "configs")
    for argv in (["--grid-configs", "64,32,4,2", "64,128,4,4,1"], ["--grid-configs", "64,32,4,2 64,128,4,4,1"]):
        assert bench_common.parse_configs("--grid-configs", ap.parse_args(argv).grid_configs) == [
            (64, 32, 4, 2), (64, 128, 4, 4, 1)]
    assert bench_common.parse_configs("--grid-configs", ap.parse_args([]).grid_configs) == []
    for script, flag in (("bench_gdpa.py", "--grid-configs"), ("bench_block_attention.py", "--bwd-configs")):
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--grid-only", flag, "4,1,1 4,x,1"]
                              if script == "bench_gdpa.py" else
                              [sys.executable, str(ROOT / "scripts" / script), "--sweep", flag, "4,1,1", "4,x,1"],
                              capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines() == [f"{flag}: '4,x,1' is not a config (comma-separated integers, "
                                                    "e.g. 64,32,4,2,0,0)"]


def test_gdpa_ab_rounds_alternate_and_summarize(monkeypatch):
    """--ab N: ours and the softmax forward timed in alternating rounds; medians, the per-round
    ratio's range and how many rounds ours won (timings stubbed)."""
    import bench_gdpa

    def ours():
        return None

    def softmax():
        return None

    monkeypatch.setattr(bench_gdpa, "implementations", lambda w: {"ours": lambda: (ours, None),
                                                                   "softmax_jagged": lambda: (softmax, None)})
    times = iter([1.0, 1.1, 1.2, 1.1, 0.9, 1.0])  # ours, softmax, ours, softmax, ...
    order = []

    def fake_graph_bench(fn):
        order.append(fn)
        return next(times)

    monkeypatch.setattr(bench_gdpa, "graph_bench", fake_graph_bench)
    ab = bench_gdpa.ab_forward(None, 3)
    assert order == [ours, softmax] * 3
    assert ab["ours_ms"] == [1.0, 1.2, 0.9] and ab["softmax_ms"] == [1.1, 1.1, 1.0]
    assert ab["ours_median_ms"] == 1.0 and ab["softmax_median_ms"] == 1.1
    assert ab["ratio_min"] == pytest.approx(1.1 / 1.2) and ab["ratio_max"] == pytest.approx(1.0 / 0.9)
    assert ab["ours_faster"] == "2 of 3"


def test_picked_configs_names_the_kernels_configs():
    saved = dict(common._config_cache)
    try:
        common._config_cache.clear()
        common._config_cache[("gdpa_fwd", 128, "bf16")] = (64, 32, 4, 3, 0, 0)
        common._config_cache[("dq", 128)] = (64, 32, 4, 3)
        assert bench_common.picked_configs(("gdpa_fwd",)) == {"gdpa_fwd/128/bf16": [64, 32, 4, 3, 0, 0]}
        assert set(bench_common.picked_configs(bench_common.PINNABLE)) == {"gdpa_fwd/128/bf16", "dq/128"}
    finally:
        common._config_cache.clear()
        common._config_cache.update(saved)


def test_host_overhead_of_the_fp8_mlp_runs_without_a_gpu():
    """scripts/host_overhead.py --op fp8_mlp --stub-launches: gemctl's own host path of the FP8 MLP
    block (every cast and GEMM wrapper, autograd) with the Triton launches stubbed, on a CPU."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "host_overhead.py"), "--op", "fp8_mlp", "--stub-launches",
                           "--calls", "3", "--top", "3"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fp8_mlp (launches stubbed) fwd+bwd: host" in proc.stdout


def test_block_attention_bench_times_the_rope_variants(monkeypatch, capsys):
    """bench_block_attention's bookkeeping on a CPU, the kernel timings stubbed: block 64 is timed
    with the model's fp16 tables, fp32 tables and no rope (what the rotation costs), blocks 32/128
    with fp16 only; the shares use the forward and backward byte counts; the table prints them."""
    import dataclasses

    import torch

    import bench_block_attention as bench
    from bench_jagged_attention import make_inputs
    from workloads import block_attention_workloads

    seen = []

    def kernel_times(q, k, v, off, max_len, block_size, tables, grad):
        seen.append((block_size, None if tables[0] is None else tables[0].dtype))
        return {"fwd_kernel_ms": 0.1 if tables[0] is None else 0.125, "bwd_kernel_ms": 0.25}

    monkeypatch.setattr(bench, "make_inputs", lambda w: make_inputs(w, device="cpu"))
    monkeypatch.setattr(bench, "kernel_times", kernel_times)
    monkeypatch.setattr(bench, "timings", lambda fwd, fwd_bwd: {"fwd_call_ms": 1.0, "fwd_bwd_call_ms": 2.0,
                                                                 "fwd_graph_ms": 0.5, "fwd_bwd_graph_ms": 1.5})
    w = block_attention_workloads()[0]
    w = dataclasses.replace(w, q_lengths=w.q_lengths[:4], k_lengths=w.k_lengths[:4])  # 4 sequences
    row = bench.run_workload(w, copy_tbps=4.0)
    assert seen == [(64, torch.float16), (64, torch.float32), (64, None), (32, torch.float16), (128, torch.float16)]
    b64 = row["block"][64]
    roof_fwd = row["fwd_bytes"] / 4.0e9  # ms at 4 TB/s
    assert b64["fwd_roofline_pct"] == pytest.approx(100 * roof_fwd / 0.125)
    assert b64["no_rope"]["fwd_roofline_pct"] == pytest.approx(100 * roof_fwd / 0.1)
    assert b64["fp32_tables"]["bwd_roofline_pct"] == pytest.approx(100 * row["bwd_bytes"] / 4.0e9 / 0.25)
    assert "no_rope" not in row["block"][32] and row["rope_table_dtype"] == "torch.float16"
    lengths = w.q_lengths.tolist()
    for bs in (32, 64, 128):  # block counts, partial blocks and rows past the sequences, counted here row by row
        starts = [s for n in lengths for s in range(0, n, bs)]
        ends = [min(s + bs, n) for n in lengths for s in range(0, n, bs)]
        assert row["block"][bs]["blocks"] == len(starts)
        assert row["block"][bs]["partial_blocks"] == sum(e - s < bs for s, e in zip(starts, ends))
        past = sum(bs - (e - s) for s, e in zip(starts, ends))
        assert row["block"][bs]["rows_past_pct"] == pytest.approx(100 * past / (bs * len(starts)))
    bench.print_tables([row], {"gpu": "cpu", "torch": "-", "triton": "-", "commit": "-", "copy_tbps": 4.0,
                               "gemm_tflops": 1.0})
    out = capsys.readouterr().out
    assert "64, fp32 tables" in out and "64, no rope" in out
    b = row["block"][64]
    assert f"block 64: {b['blocks']} blocks, {b['partial_blocks']} partial" in out


def test_block_attention_whole_blocks_variant(monkeypatch):
    """--whole-blocks: the sweep's partial-block control rounds every length up to whole 64-row blocks
    (none partial, none past the sequences, each length the least such one), and is a sweep option only."""
    import torch

    import bench_block_attention as bench
    from workloads import block_attention_workloads

    for w in block_attention_workloads():
        v = bench.whole_blocks(w)
        assert v.name == f"{w.name}-whole" and torch.equal(v.q_lengths, v.k_lengths)
        assert ((v.q_lengths % 64) == 0).all() and ((v.q_lengths - w.q_lengths) >= 0).all()
        assert ((v.q_lengths - w.q_lengths) < 64).all()
        counts = bench.block_counts(v.q_lengths.tolist(), 64)
        assert counts["partial_blocks"] == 0 and counts["rows_past_pct"] == 0
        assert counts["blocks"] == bench.block_counts(w.q_lengths.tolist(), 64)["blocks"]
    # the sweep times each selected workload, then its whole-block variant (kernel times stubbed)
    import dataclasses

    few = [dataclasses.replace(w, q_lengths=w.q_lengths[:3], k_lengths=w.k_lengths[:3]) for w in block_attention_workloads()]
    rows = _block_sweep_stubbed(monkeypatch, few, whole=True)
    assert [(r["workload"], r["kind"]) for r in rows] == [("self-1000", "fwd"), ("self-1000", "bwd"),
                                                          ("self-1000-whole", "fwd"), ("self-1000-whole", "bwd")]
    assert rows[2]["pct"] > rows[0]["pct"]  # more tokens in the same stubbed time
    _refused_without_sweep("--whole-blocks")


def _block_sweep_stubbed(monkeypatch, workloads, **variants):
    """bench_block_attention.sweep of self-1000 over ``workloads`` on the CPU with the variants asked
    (whole=, trimmed=), the kernel times stubbed (0.1 ms forward, 0.2 ms backward)."""
    import bench_block_attention as bench
    from bench_jagged_attention import make_inputs

    monkeypatch.setattr(bench, "block_attention_workloads", lambda: workloads)
    monkeypatch.setattr(bench, "make_inputs", lambda w: make_inputs(w, device="cpu"))
    monkeypatch.setattr(bench, "kernel_times", lambda *a: {"fwd_kernel_ms": 0.1, "bwd_kernel_ms": 0.2})
    return bench.sweep(["self-1000"], [128], [(4, 1, 1, 0, 0, 3)], [(4, 1, 1, 0, 0, 2)], 4.0, **variants)


def _refused_without_sweep(flag: str, *values: str) -> None:
    """bench_block_attention.py refuses a sweep-only ``flag`` (with its ``values``) given without
    --sweep: one line, exit code 2."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_block_attention.py"), flag, *values],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(f"{flag} applies to --sweep")


def test_block_attention_trimmed_tails_variant(monkeypatch):
    """--trimmed-tails: every other partial last block of at most 32 rows dropped, so the variant has
    as many blocks as a kernel pairing those blocks would run; the sweep records tokens and blocks
    per row; a sweep option only."""
    import dataclasses

    import torch

    import bench_block_attention as bench
    from workloads import block_attention_workloads

    for w in block_attention_workloads():
        v = bench.short_tails_halved(w)
        tail = w.q_lengths % 64
        short = int(((tail > 0) & (tail <= 32)).sum())
        assert v.name == f"{w.name}-trimmed" and torch.equal(v.q_lengths, v.k_lengths)
        cut = w.q_lengths - v.q_lengths
        assert int((cut > 0).sum()) == short // 2 and torch.equal(cut[cut > 0], tail[cut > 0])
        assert bench.block_counts(v.q_lengths.tolist(), 64)["blocks"] == (
            bench.block_counts(w.q_lengths.tolist(), 64)["blocks"] - short // 2)
    few = [dataclasses.replace(w, q_lengths=torch.tensor([70, 100, 80, 64]), k_lengths=torch.tensor([70, 100, 80, 64]))
           for w in block_attention_workloads()]
    rows = _block_sweep_stubbed(monkeypatch, few, trimmed=True)
    assert [(r["workload"], r["kind"]) for r in rows] == [("self-1000", "fwd"), ("self-1000", "bwd"),
                                                          ("self-1000-trimmed", "fwd"), ("self-1000-trimmed", "bwd")]
    # tails 6 and 16 are short (the second is dropped), 36 is not: 7 blocks, then 6
    assert (rows[0]["tokens"], rows[0]["blocks"]) == (314, 7) and (rows[2]["tokens"], rows[2]["blocks"]) == (298, 6)
    _refused_without_sweep("--trimmed-tails")


def test_block_attention_sweep_tables(monkeypatch):
    """--sweep-tables: the sweep's rope tables in the dtype asked (fp32: the one-program-per-SM path
    of the Gluon backward), recorded per row; the default is what a bf16 layer builds; a sweep option
    only."""
    import dataclasses

    import torch

    import bench_block_attention as bench
    from bench_jagged_attention import make_inputs
    from workloads import block_attention_workloads

    few = [dataclasses.replace(w, q_lengths=w.q_lengths[:3], k_lengths=w.k_lengths[:3]) for w in block_attention_workloads()]
    monkeypatch.setattr(bench, "block_attention_workloads", lambda: few)
    monkeypatch.setattr(bench, "make_inputs", lambda w: make_inputs(w, device="cpu"))
    seen = []
    monkeypatch.setattr(bench, "kernel_times", lambda q, k, v, off, max_len, bs, tables, grad: seen.append(
        tables[0].dtype) or {"fwd_kernel_ms": 0.1, "bwd_kernel_ms": 0.2})
    args = (["self-1000"], [128], [(4, 1, 1, 0, 0, 3)], [(4, 1, 1, 0, 0, 2)], 4.0)
    assert {r["tables"] for r in bench.sweep(*args)} == {"float16"}
    assert {r["tables"] for r in bench.sweep(*args, table_dtype=torch.float32)} == {"float32"}
    assert seen == [torch.float16] * 2 + [torch.float32] * 2
    _refused_without_sweep("--sweep-tables", "fp32")


def _source_page(rows, sampling=True) -> str:
    """An ncu --page source --csv --print-source sass page: a kernel row, the header, instructions."""
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
              "stall_long_sb", "stall_barrier", "stall_long_sb (Not Issued)"]
    if not sampling:
        header.remove("Warp Stall Sampling (All Samples)")
    lines = ['"Kernel Name","_gdpa_fwd_resident",', ",".join(f'"{h}"' for h in header)]
    for addr, sass, long_sb, barrier, executed in rows:
        fields = [addr, sass] + ([str(long_sb + barrier)] if sampling else []) + [str(executed), str(long_sb),
                                                                                   str(barrier), "0"]
        lines.append(",".join(f'"{f}"' for f in fields))
    return "\n".join(lines) + "\n"


def _sass_stalls(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "sass_stalls.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def test_sass_stalls_ranks_instructions_and_reasons(tmp_path):
    """scripts/sass_stalls.py: each reason's share of all stall samples (the not-issued columns left
    out), the instructions with the most samples first, each with its leading reasons; gzip input
    too; a page without warp-state sampling is one line naming the column, exit code 2."""
    import gzip

    import sass_stalls

    rows = [("0x7f00ad00", "IMAD.WIDE R26, R35, 0x8, R26", 60, 0, 4224),
            ("0x7f00ad10", "WARPGROUP.DEPBAR.LE gsb0, 0x0", 5, 25, 24672),
            ("0x7f00ad20", "HGMMA.64x128x16.F32.BF16", 0, 0, 24672)]
    page = _source_page(rows)
    out = sass_stalls.summarize(page.splitlines(), top=2)
    assert out["kernel"] == "_gdpa_fwd_resident" and out["samples"] == 90 and out["instructions"] == 3
    assert out["reasons"] == [("long_sb", 65 / 90), ("barrier", 25 / 90)]
    assert [t["sass"] for t in out["top"]] == ["IMAD.WIDE R26, R35, 0x8, R26", "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
    assert out["top"][0]["executed"] == 4224 and out["top"][1]["reasons"] == [("barrier", 25), ("long_sb", 5)]
    gz = tmp_path / "sass.csv.gz"
    gz.write_bytes(gzip.compress(page.encode()))
    proc = _sass_stalls(gz, "--top", "1")
    assert proc.returncode == 0 and "66.7% 0ad00 x4224" in proc.stdout and "DEPBAR" not in proc.stdout
    bad = tmp_path / "no_sampling.csv"
    bad.write_text(_source_page(rows, sampling=False))
    proc = _sass_stalls(bad)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "Warp Stall Sampling (All Samples)" in proc.stderr
    bad.write_text(page.replace('"60"', '"sixty"'))  # a count that is not a number: named, one line
    proc = _sass_stalls(bad)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "column 'Warp Stall Sampling (All Samples)' at address 0x7f00ad00 holds 'sixty'" in proc.stderr
    truncated = tmp_path / "truncated.csv.gz"
    truncated.write_bytes(gz.read_bytes()[:40])
    proc = _sass_stalls(truncated)
    assert proc.returncode == 2 and proc.stderr.startswith("sass_stalls: ") and "Traceback" not in proc.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_gdpa_bench_lets_a_pinned_probe_be_profiled():
    """--probes with --profile-step is accepted (ncu of a probe config: gpu.sh ncu-sass); without a
    GPU the script then stops at its GPU check, not at the option check."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gdpa.py"), "--profile-step", "cross-128",
                           "--probes", "--pin", "gdpa_fwd=64,128,4,2,2,16,0,0,1,1,2"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("bench_gdpa: needs a CUDA GPU")


@pytest.mark.parametrize("args,message", [
    (["--sms", "0", "scripts/bench_gdpa.py"], "--sms must be a positive number of SMs, got 0"),
    (["--like-tbps", "-1", "scripts/bench_gdpa.py"], "--like-tbps must be a positive bandwidth in TB/s, got -1.0"),
    (["--sms", "94", "scripts/no_such_bench.py"], "no script at 'scripts/no_such_bench.py'"),
])
def test_sm_limit_refuses_bad_arguments_in_one_line(args, message):
    """sm_limit.py checks its arguments before it touches a GPU: one line naming the argument, exit 2."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "sm_limit.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr[-500:]
    assert proc.stderr.strip().splitlines() == [f"sm_limit: {message}"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_sm_limit_without_a_gpu_exits_2():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "sm_limit.py"), "--h200", "scripts/bench_gdpa.py",
                           "--grid-only"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr[-500:]
    assert proc.stderr.strip().splitlines() == ["sm_limit: needs a CUDA GPU"]


def test_sm_limit_matches_the_bandwidth_per_sm():
    import sm_limit

    assert sm_limit.sms_for(132, 3.02, 4.25) == 94  # an H100 as an H200
    assert sm_limit.sms_for(132, 4.25, 4.25) == 132
    assert sm_limit.sms_for(132, 4.80, 4.25) == 132  # never more than the GPU has
    assert sm_limit.sms_for(132, 0.001, 4.25) == 1


def test_result_files_name_the_sm_limit(monkeypatch):
    monkeypatch.delenv("GEMCTL_SM_LIMIT", raising=False)
    meta = bench_common.base_meta(x=1)
    assert "sm_limit" not in meta and "held to" not in meta["gpu"] and meta["x"] == 1
    monkeypatch.setenv("GEMCTL_COMPILE_WORKERS", "3")
    assert bench_common.base_meta()["compile_workers"] == 3  # how the run's candidates compiled
    monkeypatch.setenv("GEMCTL_SM_LIMIT", "94")
    meta = bench_common.base_meta()
    assert meta["sm_limit"] == 94 and meta["gpu"].endswith("held to 94 SMs (sm_limit.py)")


@pytest.mark.gpu
def test_sm_limit_holds_the_persistent_grids_to_the_sms(tmp_path):
    """On a GPU: the script runs with the persistent grids sized to the SMs held, and the check
    kernel reached no more than those from the current stream, a new stream and a graph replay."""
    import torch

    total = torch.cuda.get_device_properties(0).multi_processor_count
    script = tmp_path / "probe.py"
    script.write_text("import os\nfrom gemctl.ops.triton import common\n"
                      "print('grid', common.num_programs(10**6, 1, 'cuda'), os.environ['GEMCTL_SM_LIMIT'])\n")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "sm_limit.py"), "--sms", str(total // 2),
                           str(script)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-800:]
    grid, limit = proc.stdout.strip().splitlines()[-1].split()[1:]
    assert int(grid) == int(limit) and total // 2 <= int(limit) < total, proc.stdout


def test_compare_sweeps_puts_groups_side_by_side(tmp_path, capsys):
    """compare_sweeps.py: a row per (workload, dim, kind, config), each group's mean over its rounds,
    the ratio of two groups; bench_gdpa grid files flattened per config; bad input one line, exit 2."""
    import json

    import compare_sweeps

    def sweep(path, gpu, bwd_ms):
        rows = [{"workload": "self-1000", "dim": 128, "kind": "bwd", "cfg": [4, 1, 1], "ms": bwd_ms, "pct": 0.1 / bwd_ms},
                {"workload": "self-1000", "dim": 128, "kind": "fwd", "cfg": [4, 1, 1], "ms": 0.1, "pct": 90.0}]
        path.write_text(json.dumps({"meta": {"gpu": gpu}, "sweep": rows}))
        return str(path)

    a = [sweep(tmp_path / f"a{i}.json", "H100", ms) for i, ms in ((1, 0.200), (2, 0.210))]
    b = [sweep(tmp_path / "b1.json", "H200", 0.300)]
    compare_sweeps.main(["--group", f"new={','.join(a)}", "--group", f"old={b[0]}", "--ratio", "new/old"])
    out = capsys.readouterr().out
    assert "| self-1000 | 128 | bwd | 4,1,1 | 205.0 us, " in out and "(2) | 300.0 us," in out
    assert "| 1.463x |" in out  # 0.300 / 0.205
    assert "new: H100" in out and "old: H200" in out
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"meta": {"gpu": "H200"}, "rows": [
        {"workload": "cross-128", "roofline_tflops": 400.0,
         "grid_sweep": [{"config": [64, 128], "fwd_graph_ms": 0.08, "fwd_graph_tflops": 300.0},
                        {"config": [64, 64], "error": "ValueError: does not fit"}]}]}))
    compare_sweeps.main(["--group", f"g={grid}"])
    out = capsys.readouterr().out
    assert "| cross-128 |  | fwd | 64,128 | 80.0 us, 75.0% (1) |" in out and "64,64" not in out  # failed: left out
    for argv, message in ((["--group", "x"], "--group takes LABEL=FILE"),
                          (["--group", f"x={tmp_path / 'none.json'}"], "none.json: not a sweep file"),
                          (["--group", f"x={a[0]}", "--ratio", "x/y"], "--ratio takes A/B with two of the labels")):
        with pytest.raises(SystemExit) as exc:
            compare_sweeps.main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_sm_limit_runs_the_script_against_its_own_tree(tmp_path):
    """sm_limit's last step (no GPU needed): the script runs as if launched directly, importing its own
    tree's gemctl and bench_common (gpu.sh times other trees through this one), its persistent grids
    sized to the limit, tuned configs in a cache of their own, result files labelled."""
    tree = tmp_path / "tree"
    (tree / "gemctl" / "ops" / "triton").mkdir(parents=True)
    (tree / "scripts").mkdir()
    for pkg in ("gemctl", "gemctl/ops", "gemctl/ops/triton"):
        (tree / pkg / "__init__.py").write_text("")
    (tree / "gemctl/ops/triton/common.py").write_text("TREE = 'other'\ndef _sm_count(device):\n    return 132\n")
    (tree / "scripts/bench_common.py").write_text("def base_meta(**extra):\n    return {'gpu': 'H100', **extra}\n")
    (tree / "scripts/probe.py").write_text(
        "import os, sys\nfrom gemctl.ops.triton import common\nimport bench_common\n"
        "print(common.TREE, common._sm_count(None), sys.argv[1:], bench_common.base_meta()['gpu'],\n"
        "      os.path.basename(os.environ['GEMCTL_CACHE_DIR']), __name__)\n")
    code = ("import argparse, sys; sys.path.insert(0, sys.argv[1]); import sm_limit; "
            "sm_limit._run_held(argparse.Namespace(script=sys.argv[2], args=['--x', '1']), 96, 'test line')")
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT / "scripts"), str(tree / "scripts/probe.py")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**__import__("os").environ, "GEMCTL_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-800:]
    assert proc.stdout.splitlines() == ["sm_limit: test line",
                                        "other 96 ['--x', '1'] H100 held to 96 SMs (sm_limit.py) sm_limit_96 __main__"]


def test_loss_compare_reads_skipped_steps(tmp_path):
    """A skipped step's loss is null in summary.json: loss_compare counts it as a mismatch when only
    one run skipped it, leaves it out of the mean, and matches two runs that skipped the same step."""
    import json

    script = str(ROOT / "scripts" / "loss_compare.py")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"losses": [0.5, None, 0.4]}))
    b.write_text(json.dumps({"losses": [0.5, 0.6, 0.4]}))
    one = subprocess.run([sys.executable, script, str(a), str(b)], capture_output=True, text=True)
    assert one.returncode == 1 and "1 of 3 steps above rtol" in one.stdout
    assert "mean loss a 0.450000 (1 non-finite steps left out)  b 0.500000" in one.stdout
    both = subprocess.run([sys.executable, script, str(a), str(a)], capture_output=True, text=True)
    assert both.returncode == 0 and "0 of 3 steps above rtol" in both.stdout


def test_fp8_bench_mlp_cast_set_is_the_fused_blocks_six_casts():
    """--cast-set mlp: the row casts with column bytes at the linears' run length and the column
    casts from such bytes (plain, SiLU, RMSNorm), not the plain row casts, other run lengths, the
    two-read column casts or torch's rms_norm."""
    import bench_fp8

    names = ["rows", "rows + column maxima, 16-row runs", "rows + column maxima, 64-row runs",
             "cols transposed, 4096-token chunks, 2 reads", "cols transposed, 4096-token chunks, from column maxima",
             "rows, silu on the fly", "rows + column maxima, silu on the fly, 16-row runs",
             "cols transposed, silu on the fly, 4096-token chunks, 2 reads",
             "cols transposed, silu on the fly, 4096-token chunks, from column maxima", "torch rms_norm (bf16 out)",
             "rows, RMSNorm fused", "rows + column maxima, RMSNorm fused, 16-row runs",
             "cols transposed, RMSNorm recomputed, 4096-token chunks, from column maxima",
             "cols transposed, 4096-token chunks, from 64-row column maxima"]
    picked = [n for n in names if bench_fp8.is_mlp_cast(n, 16)]
    assert picked == ["rows + column maxima, 16-row runs", "cols transposed, 4096-token chunks, from column maxima",
                      "rows + column maxima, silu on the fly, 16-row runs",
                      "cols transposed, silu on the fly, 4096-token chunks, from column maxima",
                      "rows + column maxima, RMSNorm fused, 16-row runs",
                      "cols transposed, RMSNorm recomputed, 4096-token chunks, from column maxima"]
    # --cast-set block: at d the RMSNorm and plain pairs, at 4d the SiLU and plain pairs
    assert bench_fp8.block_roles(1024) == ("d",) and bench_fp8.block_roles(8192) == ("4d",)
    assert bench_fp8.block_roles(768) == ()
    at_d = [n for n in picked if bench_fp8.is_mlp_cast(n, 16, ("d",))]
    at_4d = [n for n in picked if bench_fp8.is_mlp_cast(n, 16, ("4d",))]
    assert at_d == picked[:2] + picked[4:] and at_4d == picked[:4]


def test_fp8_bench_block_cast_set_rejects_other_widths():
    """--cast-set block knows the casts of the mlp shapes' widths only: another width is one line and
    exit code 2, before any GPU work."""
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_fp8.py"), "--only", "cast", "--cast-set", "block",
                          "--cast-widths", "1024,768"], capture_output=True, text=True)
    assert run.returncode == 2
    assert "--cast-widths 1024,768: --cast-set block takes the widths of the mlp shapes (1024, 4096, 2048, 8192)" \
        in run.stderr
