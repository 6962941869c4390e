"""Data-parallel layouts on CPU (gloo, several torchrun processes): FSDP over 2 ranks and HSDP 2x2
train the same losses as one process at the same global batch, and `gemctl train
launcher=torchrun` works end to end (one run directory, rank-0 summary with the global numbers).

Same global batch: every run uses Base Batch Shuffling with sub-batches of 8 samples, so a step
covers the same sample units whatever the world size (one process takes all of them); FSDP and
HSDP average gradients over ranks, and each rank's loss is its local mean, so the global loss is
the mean over ranks. What differs is the order of floating-point reductions.
"""

import glob
import json
import os
import subprocess
import sys

import pytest

from gemctl.config.compose import compose
from gemctl.config.validate import validate
from gemctl.errors import UserError

COMMON = [
    "train.steps=8", "train.warmup_timing_steps=2", "train.log_every=2", "run.progress=false",
    "shuffle=bbs", "shuffle.sub_batch_size=8", "data.synthetic.eval_samples=64", "data.eval_batch_size=64",
]
# fp32 on CPU, reductions in another order: measured max relative difference 1.2e-7 (FSDP 2) and
# 1.2e-7 (HSDP 2x2) over the 8 steps; a wrong gradient average or a lost sample is >= 1e-2.
RTOL = 1e-5


def _torchrun(tmp_path, nproc: int, overrides: list[str]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("TRITON_INTERPRET", None)
    env.setdefault("GEMCTL_COMPILE_BACKEND", "aot_eager")  # parallel.compile without a C++ toolchain
    cmd = [sys.executable, "-m", "gemctl", "train", "launcher=torchrun", f"launcher.nproc_per_node={nproc}",
           f"run.output_dir={tmp_path}", *COMMON, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (summary,) = glob.glob(str(tmp_path / "default" / "*" / "summary.json"))
    return json.loads(open(summary).read())


def _plan(nproc: int, overrides: list[str]) -> dict:
    from gemctl.data.source import build_source
    from gemctl.parallel.plan import build_plan

    cfg = compose(["launcher=torchrun", f"launcher.nproc_per_node={nproc}", *COMMON, *overrides])
    validate(cfg)
    return build_plan(cfg, build_source(cfg.data, cfg.shuffle))


def _single(tmp_path, overrides: list[str]) -> dict:
    from gemctl.train.trainer import train

    cfg = compose(COMMON + overrides)
    validate(cfg)
    result = train(cfg, run_root=str(tmp_path / "single"))
    return {"losses": result.losses, "grad_norms": result.grad_norms, "perf": result.perf}


def _assert_close(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= RTOL * abs(b), f"step {i + 1}: {a} vs {b}"


def _tables(kind: str) -> list[str]:
    return ["parallel=fsdp", "parallel.sparse.sharding=torchrec", f"parallel.sparse.sharding_types=[{kind}]"]


@pytest.mark.parametrize("nproc,layout,global_batch", [
    (2, ["parallel=fsdp"], 16),
    (4, ["parallel=hsdp", "parallel.dp_shard=2", "parallel.topology.gpus_per_node=2"], 32),
    (2, ["parallel=fsdp", "parallel.compile=true"], 16),  # the ranks' layers compiled (GEMCTL_COMPILE_BACKEND)
    (2, _tables("table_wise"), 16),
    (2, _tables("row_wise"), 16),
    (2, _tables("column_wise"), 16),
    # The load-balancing loss is per rank (its local tokens, as Switch computes it per device), so
    # with a nonzero weight the global loss is not one process's; the MoE itself must match.
    (2, ["parallel=fsdp", "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.aux_loss_weight=0"], 16),
    (2, ["parallel=fsdp", "parallel.ep=2", "parallel.topology.gpus_per_node=2", "model.moe.n_experts=4",
         "model.moe.top_k=2", "model.moe.aux_loss_weight=0"], 16),
    (4, ["parallel=hsdp", "parallel.dp_shard=2", "parallel.ep=2", "parallel.topology.gpus_per_node=2",
         "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.aux_loss_weight=0"], 32),
    # Activation checkpointing inside FSDP2 units (the backward re-gathers for the rerun forward),
    # and with expert parallelism (the rerun forward's all-to-alls): the single process has none.
    (2, ["parallel=fsdp", "parallel.activation_checkpoint.mode=full"], 16),
    (2, ["parallel=fsdp", "parallel.ep=2", "parallel.topology.gpus_per_node=2", "model.moe.n_experts=4",
         "model.moe.top_k=2", "model.moe.aux_loss_weight=0", "parallel.activation_checkpoint.mode=ops"], 16),
], ids=["fsdp-2", "hsdp-2x2", "fsdp-2-compiled", "tables-table_wise", "tables-row_wise", "tables-column_wise", "fsdp-2-moe",
        "ep-2-moe", "hsdp-2x2-ep-2-moe", "fsdp-2-checkpoint-full", "ep-2-moe-checkpoint-ops"])
def test_layout_matches_single_process(tmp_path, nproc, layout, global_batch):
    """Measured max relative loss difference over the 8 steps: 1.2e-7 (FSDP, HSDP, table-wise,
    column-wise), 1.1e-7 (row-wise); the torchrec runs use fbgemm's fused row-wise Adagrad, the
    single process gemctl's own."""
    dist = _torchrun(tmp_path, nproc, layout + ["data.batch_size=8"])
    model = [o for o in layout if o.startswith("model.")]
    single = _single(tmp_path, model + [f"data.batch_size={global_batch}"])
    _assert_close(dist["losses"], single["losses"])
    # the gradient norm before clipping is the global one: every rank's shard (and each expert once)
    _assert_close(dist["grad_norms"], single["grad_norms"])
    perf = dist["perf"]
    modes = [o.split("=")[1] for o in layout if o.startswith("parallel.activation_checkpoint.mode=")]
    assert perf["activation_checkpoint"].split(":")[0] == (modes[0] if modes else "none")
    if "parallel.sparse.sharding=torchrec" in layout:
        kind = layout[-1].split("[")[1].rstrip("]")
        assert {t["sharding"] for t in perf["table_plan"].values()} == {kind}
        assert len(perf["table_plan"]) == 5
        # `gemctl plan` runs the same planner offline: the same placement as the job's.
        plan = _plan(nproc, layout + ["data.batch_size=8"])
        assert {t["table"]: t["torchrec"] for t in plan["tables"]} == perf["table_plan"]
        return
    assert perf["table_plan"] is None
    # `gemctl plan` predicts rank 0's parameter bytes exactly (the FSDP2 shards it measured).
    plan = _plan(nproc, layout + ["data.batch_size=8"])
    assert plan["memory_bytes_rank0"]["params"] == perf["param_bytes"]
    assert plan["memory_bytes_rank0"]["params"] < single["perf"]["param_bytes"]
    assert perf["world_size"] == nproc and perf["local_mfu"] is None
    # Global counts: the summed samples over the timed steps at the global batch.
    assert perf["qps"] == pytest.approx(perf["qps_per_rank"] * nproc)
    assert perf["qps"] * perf["step_time_ms"] / 1e3 == pytest.approx(global_batch, rel=1e-6)


# The same layouts over NCCL on two GPUs. fp32 compute (TF32 matmuls, as every run sets) and the
# untimed default kernel configs (GEMCTL_AUTOTUNE=0), so the single process and the ranks run the
# same kernels and only the order of reductions differs.
GPU_FP32 = ["train.device=cuda", "precision.compute_dtype=fp32"]
GPU_RTOL = 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [
    ["parallel=fsdp", "parallel.topology.gpus_per_node=2"],
    ["parallel=hsdp", "parallel.dp_shard=1", "parallel.topology.gpus_per_node=2"],
    ["parallel=fsdp", "parallel.ep=2", "parallel.topology.gpus_per_node=2", "model.moe.n_experts=4",
     "model.moe.top_k=2", "model.moe.aux_loss_weight=0"],
], ids=["fsdp-2", "hsdp-2x1", "ep-2-moe"])
def test_layout_matches_single_process_on_two_gpus(tmp_path, monkeypatch, layout):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    monkeypatch.setenv("GEMCTL_AUTOTUNE", "0")
    dist = _torchrun(tmp_path, 2, layout + GPU_FP32 + ["data.batch_size=8"])
    model = [o for o in layout if o.startswith("model.")]
    single = _single(tmp_path, model + GPU_FP32 + ["data.batch_size=16"])
    worst = max(abs(a - b) / abs(b) for a, b in zip(dist["losses"], single["losses"]))
    print(f"{'/'.join(layout)}: max relative loss difference {worst:.3e} over {len(single['losses'])} steps")
    assert len(dist["losses"]) == len(single["losses"]) and worst <= GPU_RTOL
    assert dist["perf"]["world_size"] == 2


def test_torchrun_run_directory(tmp_path):
    summary = _torchrun(tmp_path, 2, ["parallel=fsdp", "data.batch_size=8"])
    (run,) = glob.glob(str(tmp_path / "default" / "*"))
    assert sorted(os.listdir(run)) == ["config.yaml", "curves.png", "metrics.jsonl", "summary.json"]  # rank 0's only
    assert summary["eval"]["samples"] == 64


@pytest.mark.slow
def test_scaling_ratio_from_the_single_rank_baseline(tmp_path):
    summary = _torchrun(tmp_path, 2, ["parallel=fsdp", "data.batch_size=8", "metrics.scaling_baseline_steps=3"])
    perf = summary["perf"]
    assert perf["local_baseline"]["steps"] == 3 and perf["local_baseline"]["model_tflops"] > 0
    assert 0 < perf["scaling_ratio"] and 0 < perf["local_mfu"] < 1
    assert perf["e2e_mfu"] == pytest.approx(perf["local_mfu"] * perf["scaling_ratio"], rel=1e-9)
    # The baseline trains a copy: the job's own losses are those of a run without it.
    plain = _torchrun(tmp_path / "plain", 2, ["parallel=fsdp", "data.batch_size=8"])
    assert summary["losses"] == plain["losses"]


def test_plan_groups_and_tiers():
    from gemctl.parallel.plan import _groups

    groups = _groups(rep=4, shard=4, gpn=4, npz=2)  # 16 ranks, 4 nodes of 4, 2 nodes per zone
    assert groups["dp_shard"] == {"count": 4, "size": 4, "tier": "intra-node (NVLink)",
                                  "examples": [[0, 1, 2, 3], [4, 5, 6, 7], [12, 13, 14, 15]]}
    assert groups["dp_replicate"]["examples"][0] == [0, 4, 8, 12]
    assert groups["dp_replicate"]["tier"] == "cross-zone"
    assert _groups(rep=2, shard=4, gpn=4, npz=2)["dp_replicate"]["tier"] == "inter-node (zone network)"


def test_plan_single_rank_and_hsdp_communication():
    one = _plan(1, ["launcher.nproc_per_node=1", "parallel=single", "data.batch_size=8"])
    assert one["communication_per_step"] == [] and one["memory_bytes_rank0"]["gathered_params"] == 0
    params = one["dense_params"] + one["embedding_params"]
    assert one["memory_bytes_rank0"]["params"] == 4 * params
    hsdp = _plan(4, ["parallel=hsdp", "parallel.dp_shard=2", "parallel.topology.gpus_per_node=2", "data.batch_size=8"])
    kinds = [c["collective"] for c in hsdp["communication_per_step"]]
    assert kinds == ["all-gather (forward)", "all-gather (backward re-gather)", "reduce-scatter (gradients, fp32)",
                     "all-reduce (gradient shards, fp32)"]
    # Reduce-scatter over 2 ranks moves half of the fp32 gradients.
    assert hsdp["communication_per_step"][2]["bytes"] == 4 * params // 2


def test_plan_cli(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gemctl", "plan", "--world", "64", "--json", "model=small",
                           "parallel=hsdp"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert (plan["world_size"], plan["dp_replicate"], plan["dp_shard"]) == (64, 8, 8)
    tables = subprocess.run([sys.executable, "-m", "gemctl", "plan", "--world", "16", "parallel=fsdp"],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert tables.returncode == 0, tables.stderr
    assert "[0, 1, 2, 3, ..., 14, 15]" in tables.stdout and "'...'" not in tables.stdout
    assert "FSDP row shards: 1 row per rank over dp_shard=16" in tables.stdout  # seq_action: 8 rows
    bad = subprocess.run([sys.executable, "-m", "gemctl", "plan", "--world", "12"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip() == ("gemctl: error: --world: 12 must be >= 1 and, above one node, a multiple of "
                                  "parallel.topology.gpus_per_node=8")


def test_fp32_layers_keep_fp32_parameters_under_fsdp():
    """bf16 gathering on CUDA, except units holding an fp32 layer of the recipe (the task heads in
    the bf16 recipe run outside autocast and need fp32 weights)."""
    import torch

    from gemctl.data.source import build_source
    from gemctl.parallel.dense import unit_param_dtypes
    from gemctl.parallel.plan import meta_model
    from gemctl.precision.rules import resolve_formats

    cfg = compose(["precision=bf16", "precision.rules=[{match: 'tower.layers.1.mlp*', format: fp32}]"])
    model = meta_model(cfg, build_source(cfg.data, cfg.shuffle).spec)
    formats = resolve_formats(model, cfg.precision, cfg.model.num_layers)
    dtypes = unit_param_dtypes(model, formats, "cuda", "bf16")
    assert dtypes["tower.layers.1"] == torch.float32 and dtypes["tower.layers.0"] == torch.bfloat16
    assert dtypes["cross"] == torch.bfloat16
    assert set(unit_param_dtypes(model, formats, "cpu", "bf16").values()) == {torch.float32}


def test_torchrun_command_static_rendezvous():
    from pathlib import Path

    from gemctl.launch.torchrun import torchrun_command

    cfg = compose(["launcher=torchrun", "parallel=fsdp", "launcher.nnodes=2", "launcher.node_rank=1",
                   "launcher.rdzv_endpoint=node0:29400"])
    validate(cfg)
    cmd = torchrun_command(cfg, Path("run/config.yaml"))
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert cmd[3:] == ["--nproc_per_node=8", "--nnodes=2", "--max_restarts=0", "--node_rank=1",
                       "--master_addr=node0", "--master_port=29400", "-m", "gemctl.launch.worker", "run/config.yaml"]


def test_mis_sized_layout_fails_before_launch(tmp_path):
    cmd = [sys.executable, "-m", "gemctl", "train", "launcher=torchrun", "launcher.nproc_per_node=3",
           "parallel=hsdp", "parallel.dp_shard=2", f"run.output_dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "gemctl: error: parallel.dp_shard: 2 does not divide the world size 3 (launcher), so "
        "parallel.dp_replicate=-1 cannot fill it"
    ]
    assert not os.listdir(tmp_path)  # nothing written


def test_slurm_dry_run_prints_the_job_script(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "gemctl", "train", "--dry-run", "launcher=slurm", "launcher.nnodes=4",
         "launcher.partition=gpu", "launcher.account=ads", "launcher.time_min=120", "launcher.cpus_per_task=64",
         "launcher.rdzv_port=29600", "parallel=hsdp", "train.device=cuda", f"run.output_dir={tmp_path}",
         "run.name=sweep1"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    run_dir = out[0].split(": ", 1)[1]
    assert run_dir.startswith(str(tmp_path / "sweep1"))
    sbatch = [ln for ln in out if ln.startswith("#SBATCH")]
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --account=ads", "#SBATCH --time=120",
                 "#SBATCH --cpus-per-task=64", "#SBATCH --job-name=gemctl-sweep1",
                 f"#SBATCH --output={run_dir}/slurm/%j_0_log.out"):
        assert line in sbatch, line
    srun = next(ln for ln in out if ln.startswith("srun "))
    assert srun.endswith(f"-u -m submitit.core._submit {run_dir}/slurm")
    node = out[-1].split()
    assert node[1:] == ["-m", "torch.distributed.run", "--nproc_per_node=8", "--nnodes=4", "--max_restarts=0",
                        "--node_rank=$SLURM_NODEID", "--master_addr=<first", "host", "of", "$SLURM_JOB_NODELIST>",
                        "--master_port=29600", "-m", "gemctl.launch.worker", f"{run_dir}/config.yaml"]
    assert not os.listdir(tmp_path)  # a dry run writes nothing


def test_slurm_without_slurm_fails_cleanly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gemctl", "train", "launcher=slurm", "parallel=hsdp",
                           f"run.output_dir={tmp_path}"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PATH="/nonexistent:" + os.path.dirname(sys.executable)))
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("gemctl: error: launcher=slurm: no Slurm on this machine (sbatch not found); "
                                   "add --dry-run to print the job script instead")
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("field,value", [("launcher.partition", "gpu;rm -rf ~"), ("launcher.account", "a b"),
                                         ("run.name", "x$(id)"), ("launcher.constraint", "h200`id`")])
def test_slurm_refuses_shell_metacharacters(tmp_path, field, value):
    from gemctl.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        validate(compose(["launcher=slurm", "parallel=hsdp", f"{field}='{value}'"]))
    assert info.value.field == field and "a Slurm script would interpret" in str(info.value)


def test_dry_run_needs_slurm():
    proc = subprocess.run([sys.executable, "-m", "gemctl", "train", "--dry-run"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "only launcher=slurm has a job script" in proc.stderr


def test_profile_under_torchrun(tmp_path):
    """`gemctl profile` on 2 gloo ranks: every rank profiles, rank 0 reports the breakdown with
    communication, straggler wait and the MFU identity."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "gemctl", "profile", "launcher=torchrun", "launcher.nproc_per_node=2",
                           "parallel=fsdp", "profile.steps=3", "profile.warmup_steps=2", "data.batch_size=16",
                           f"run.output_dir={tmp_path}"], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (run,) = glob.glob(str(tmp_path / "default-profile" / "*"))
    files = set(os.listdir(run))
    assert {"profile.json", "trace-rank0.json", "trace-rank1.json", "breakdown.png", "waterfall.png"} <= files
    report = json.loads(open(os.path.join(run, "profile.json")).read())
    assert report["ranks"] == 2 and [r["rank"] for r in report["per_rank"]] == [0, 1]
    assert report["categories_s"]["communication"] > 0
    for r in report["per_rank"]:
        assert 0 <= r["straggler_wait_s"] <= r["communication_s"]
        assert r["exposed_communication_s"] == pytest.approx(r["communication_s"] - r["straggler_wait_s"])
    assert report["accounted_s"] == pytest.approx(report["profiled_step_time_s"], rel=0.05)
    assert report["straggler_skew"]["work_time"] >= 1 and report["straggler_skew"]["flops"] >= 1
    assert report["e2e_mfu"] == pytest.approx(report["local_mfu"] * report["scaling_ratio"], rel=1e-9)


@pytest.mark.slow
def test_fsdp_exact_resume(tmp_path):
    """FSDP over 2 ranks: each rank writes its shards; a run resumed from step 4 continues with
    exactly the uninterrupted run's losses."""
    ckpts = tmp_path / "ckpt"
    full = _torchrun(tmp_path / "full", 2, ["parallel=fsdp", "data.batch_size=8", "train.checkpoint_every=4",
                                            f"train.checkpoint_dir={ckpts}", "train.keep_last=0",
                                            "train.async_checkpoint=true"])  # written in the background
    assert sorted(os.listdir(ckpts)) == ["step-00000004", "step-00000008"]
    assert {"rank0.pt", "rank1.pt", "meta.json", ".metadata"} <= set(os.listdir(ckpts / "step-00000004"))
    resumed = _torchrun(tmp_path / "resumed", 2, ["parallel=fsdp", "data.batch_size=8",
                                                  f"train.resume={ckpts / 'step-00000004'}"])
    assert resumed["losses"] == full["losses"][4:]
    # Another world size: DCP reshards the FSDP2 shards into one unsharded process (same global
    # batch, so the same samples per step): the losses continue as the 2-rank run's.
    single = _single(tmp_path, ["data.batch_size=16", f"train.resume={ckpts / 'step-00000004'}"])
    _assert_close(single["losses"], full["losses"][4:])


def test_resume_layout_changes_that_cannot_load():
    from types import SimpleNamespace

    from gemctl.train.checkpoint import _check_layout

    def job(world, sharding):
        return SimpleNamespace(ctx=SimpleNamespace(world_size=world),
                               cfg=SimpleNamespace(parallel=SimpleNamespace(sparse=SimpleNamespace(sharding=sharding))))

    said = []
    _check_layout(job(4, "fsdp"), "ck", {"world_size": 2, "sparse_sharding": "fsdp"}, said.append)
    assert "resharded" in said[0]
    with pytest.raises(UserError, match="written with parallel.sparse.sharding=fsdp, this job uses torchrec"):
        _check_layout(job(2, "torchrec"), "ck", {"world_size": 2, "sparse_sharding": "fsdp"}, said.append)
    with pytest.raises(UserError, match="torchrec table shards of 2 ranks, this job has 4"):
        _check_layout(job(4, "torchrec"), "ck", {"world_size": 2, "sparse_sharding": "torchrec"}, said.append)


@pytest.mark.parametrize("layout", [
    ["parallel=fsdp", "parallel.ep=2", "parallel.topology.gpus_per_node=2", "model.moe.n_experts=4",
     "model.moe.top_k=2"],
    _tables("row_wise"),
    _tables("table_wise"),
], ids=["ep-2-moe", "tables-row_wise", "tables-table_wise"])
def test_exact_resume_with_experts_and_sharded_tables(tmp_path, layout):
    """Expert-parallel experts (each EP rank saves its slice, replicas deduplicated) and torchrec's
    sharded tables with their fused optimizer state: resumed from step 4, the losses continue
    exactly as the uninterrupted run's."""
    ckpts = tmp_path / "ckpt"
    full = _torchrun(tmp_path / "full", 2, layout + ["data.batch_size=8", "train.checkpoint_every=4",
                                                     f"train.checkpoint_dir={ckpts}", "train.keep_last=0"])
    resumed = _torchrun(tmp_path / "resumed", 2, layout + ["data.batch_size=8", f"train.resume={ckpts / 'step-00000004'}"])
    assert resumed["losses"] == full["losses"][4:]
