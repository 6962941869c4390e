"""The kernel benchmarks' command line: --pin for --profile-step (what ncu measures); the host-cost
script on a CPU."""

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
