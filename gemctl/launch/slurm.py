"""launcher=slurm: a batch job through submitit, one task per node; each task runs torchrun for
its node (node rank from Slurm, rendezvous on the allocation's first node), and torchrun runs
gemctl.launch.worker on every GPU with the resolved config.yaml of the run directory.

`gemctl train launcher=slurm ... --dry-run` prints the sbatch script submitit would submit and
the per-node command, and writes nothing. The script comes from submitit's own generator with
the parameters the submission uses (submitit 1.5: ``submitit.slurm.slurm._make_sbatch_string``,
the function its SlurmExecutor calls; not public API, so it is pinned in a test).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from gemctl.errors import UserError
from gemctl.launch.torchrun import torchrun_command, worker_env
from gemctl.metrics.sinks import RunDir


def slurm_parameters(cfg) -> dict:
    """submitit SlurmExecutor parameters of the job (also what the dry run renders)."""
    launcher = cfg.launcher
    params = {"job_name": f"gemctl-{cfg.run.name}", "nodes": launcher.nnodes, "ntasks_per_node": 1,
              "gpus_per_node": launcher.nproc_per_node, "time": launcher.time_min}
    for key in ("partition", "account", "qos", "constraint", "cpus_per_task", "mem"):
        value = getattr(launcher, key)
        if value is not None:
            params[key] = value
    return params


class NodeTask:
    """What each Slurm task (one per node) runs: torchrun for this node."""

    def __init__(self, cfg_yaml: str, config_path: str, run_dir: str):
        self.cfg_yaml, self.config_path, self.run_dir = cfg_yaml, config_path, run_dir

    def command(self, node_rank, master: str) -> list[str]:
        cfg = OmegaConf.create(self.cfg_yaml)
        return torchrun_command(cfg, Path(self.config_path), node_rank=node_rank,
                                endpoint=f"{master}:{cfg.launcher.rdzv_port}")

    def __call__(self) -> int:
        import submitit

        env = submitit.JobEnvironment()
        cmd = self.command(env.node, env.hostnames[0])
        run_env = worker_env(self.run_dir)
        code = subprocess.run(cmd, env=run_env).returncode
        if code:
            raise RuntimeError(f"torchrun on node {env.node} exited with code {code}")
        return code


def planned_run_dir(cfg) -> Path:
    return (Path(cfg.run.output_dir) / cfg.run.name / time.strftime("%Y%m%d-%H%M%S")).resolve()


def dry_run(cfg, console) -> int:
    """Print the sbatch script and the per-node command; create nothing."""
    from submitit.slurm import slurm

    run_dir = planned_run_dir(cfg)
    folder = run_dir / "slurm"
    script = slurm._make_sbatch_string(command=f"{sys.executable} -u -m submitit.core._submit {folder}",
                                       folder=folder, **slurm_parameters(cfg))
    node = NodeTask(OmegaConf.to_yaml(cfg), str(run_dir / "config.yaml"), str(run_dir))
    print(f"# run directory (created at submission): {run_dir}")
    print(script, end="" if script.endswith("\n") else "\n")
    print("# each task (one per node) runs, with its node rank and the allocation's first host:")
    print(" ".join(node.command("$SLURM_NODEID", "<first host of $SLURM_JOB_NODELIST>")))
    return 0


def submit(cfg, console) -> int:
    if shutil.which("sbatch") is None:
        raise UserError("launcher=slurm: no Slurm on this machine (sbatch not found); "
                        "add --dry-run to print the job script instead")
    import submitit

    run = RunDir.create(Path(cfg.run.output_dir).resolve(), cfg.run.name)
    config_path = run.write_text("config.yaml", OmegaConf.to_yaml(cfg))
    executor = submitit.SlurmExecutor(folder=run.path / "slurm")
    executor.update_parameters(**slurm_parameters(cfg))
    job = executor.submit(NodeTask(OmegaConf.to_yaml(cfg), str(config_path), str(run.path)))
    console.print(f"submitted Slurm job {job.job_id}: {cfg.launcher.nnodes} nodes x {cfg.launcher.nproc_per_node} GPUs; "
                  f"run directory {run.path}, logs {run.path / 'slurm'}")
    return 0
