"""One GELU variant of docs/runs/2026-12-01_gdpa_act_variants.py on the H200: its values against the
exact erf GELU, the GDPA forward's output against the committed kernel's (cross-128), and the
forward's CUDA-graph time under pinned configs on the four GDPA workloads (bench_gdpa.py --grid-only).

    ACT_VARIANT=committed|relu|fp32|f16x2 python3 docs/runs/2026-12-01_gdpa_act_probe.py OUT_DIR
"""

import importlib
import json
import math
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(Path(__file__).resolve().parent)]
variants = importlib.import_module("2026-12-01_gdpa_act_variants")
name = os.environ["ACT_VARIANT"]
variants.apply(name)

import bench_gdpa  # noqa: E402
from bench_jagged_attention import make_inputs  # noqa: E402
from gemctl import ops  # noqa: E402
from workloads import cross_workload  # noqa: E402

out_dir = Path(sys.argv[1])
x = torch.linspace(-12, 12, 2_400_001, device="cuda", dtype=torch.float32)
exact = x.double() * 0.5 * (1 + torch.special.erf(x.double() / math.sqrt(2)))
y = variants.values(x).double()
err = (y - exact).abs()
bf16_round = (exact.to(torch.bfloat16).double() - exact).abs()
big = exact.abs() >= 0.125
summary = {"variant": name, "max_abs_err": err.max().item(), "argmax_x": x[err.argmax()].item(),
           "max_abs_err_abs_x_le_4": err[x.abs() <= 4].max().item(),
           "points_above_bf16_rounding_where_abs_gelu_ge_1_8": int(((err > bf16_round) & big).sum()),
           "points": x.numel()}
w = cross_workload(256, 128)
q, k, v, qo, ko, *_ = make_inputs(w)
with torch.no_grad():
    o = ops.gdpa(q, k, v, qo, ko, int(w.q_lengths.max()), int(w.k_lengths.max()), activation="gelu", backend="triton")
ref_path = out_dir / "o_committed.pt"
if name == "committed":
    torch.save(o.cpu(), ref_path)
elif ref_path.exists():
    ref = torch.load(ref_path).to(o.device).float()
    summary["o_rel_frobenius_vs_committed"] = ((o.float() - ref).norm() / ref.norm()).item()
    summary["o_max_abs_vs_committed"] = (o.float() - ref).abs().max().item()
print(json.dumps(summary), flush=True)
(out_dir / f"act_{name}_values.json").write_text(json.dumps(summary, indent=1))
tag = name + ("_flat" + os.environ["GDPA_FLAT"] if os.environ.get("GDPA_FLAT", "-1") != "-1" else "")
configs = os.environ.get("GRID_CONFIGS", "64,32,4,3,0,0 64,32,4,2,0,0,0,128 64,32,4,3,0,4 64,32,4,3,0,8").split()
only = os.environ.get("ONLY", "").split()
sys.argv = ["bench_gdpa.py", "--grid-only", "--out", str(out_dir / f"act_{tag}_grid.json"), "--grid-configs", *configs,
            *(["--only", *only] if only else [])]
bench_gdpa.main()
