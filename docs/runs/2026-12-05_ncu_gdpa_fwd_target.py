"""ncu target: the GDPA cross-128 forward under one forced config (probes allowed): 3 warm runs, then one profiled."""
import sys
sys.path.insert(0, "scripts")  # run from the repository root
import torch
from bench_gdpa import jagged_impl
from workloads import cross_workload
from gemctl import ops
from gemctl.ops.triton import common, gdpa_hopper

gdpa_hopper.PROBES = True
cfg = tuple(int(x) for x in sys.argv[1].split(","))
fwd, _ = jagged_impl(cross_workload(256, 128), lambda *a: ops.gdpa(*a, activation="gelu", backend="triton"))
with common.forced_config(cfg):
    for _ in range(3):
        fwd()
    torch.cuda.synchronize()
    print("profiled config", cfg, flush=True)
    torch.cuda.profiler.start()
    fwd()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
