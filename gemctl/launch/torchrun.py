"""launcher=torchrun: write the resolved config into a fresh run directory, then start
torch.distributed.run, which runs `python -m gemctl.launch.worker <config.yaml>` on every rank.

Every rank reads the same resolved YAML (no re-composition, so no rank can see a different
config), rank 0 writes metrics and the summary into the same run directory and prints to the
console; the other ranks stay quiet unless they fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from gemctl.metrics.sinks import RunDir


def torchrun_command(cfg, config_path: Path, node_rank=None, endpoint: str | None = None,
                     python: str = sys.executable, mode: str = "train") -> list[str]:
    """The exact command line: standalone rendezvous on one node, a static one across nodes
    (node rank and host:port from the launcher config unless given, as a Slurm task does)."""
    launcher = cfg.launcher
    cmd = [python, "-m", "torch.distributed.run", f"--nproc_per_node={launcher.nproc_per_node}",
           f"--nnodes={launcher.nnodes}", f"--max_restarts={launcher.max_restarts}"]
    if launcher.nnodes == 1:
        cmd.append("--standalone")  # a free local port: parallel jobs on one machine do not collide
    else:
        host, port = (endpoint or launcher.rdzv_endpoint).rsplit(":", 1)
        node_rank = launcher.node_rank if node_rank is None else node_rank
        cmd += [f"--node_rank={node_rank}", f"--master_addr={host}", f"--master_port={port}"]
    return cmd + ["-m", "gemctl.launch.worker"] + (["--profile"] if mode == "profile" else []) + [str(config_path)]


def worker_env(run_dir) -> dict:
    """Environment of torchrun and its workers: the run directory, and a rendezvous store per
    attempt. torchrun shares one store across restarts by default, so a restarted worker can read
    the previous attempt's connection keys and fail to connect (pytorch/pytorch#135712)."""
    env = dict(os.environ, GEMCTL_RUN_DIR=str(run_dir))
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return env


def check_resume(cfg) -> None:
    """A ``train.resume`` path that holds no published checkpoint is the user's error, found here
    before a run directory is made or torchrun starts (the ranks would each fail on it, and the
    directory would be left behind). ``none`` and ``auto`` always pass; a checkpoint of another
    model is still found by the ranks, which name the tensor."""
    resume = cfg.train.resume
    if resume not in ("none", "auto"):
        from gemctl.train import checkpoint

        checkpoint.find(resume, Path(resume))


def launch(cfg, console, run_dir: Path | None = None, mode: str = "train") -> tuple[int, Path]:
    """Run the job (in ``run_dir``, or a fresh run directory); returns torchrun's exit code and
    the run directory. ``mode="profile"`` runs `gemctl profile` on every rank instead."""
    if mode == "train":
        check_resume(cfg)
    name = cfg.run.name + ("-profile" if mode == "profile" else "")
    run = RunDir(Path(run_dir)) if run_dir is not None else RunDir.create(cfg.run.output_dir, name)
    config_path = run.write_text("config.yaml", OmegaConf.to_yaml(cfg))
    cmd = torchrun_command(cfg, config_path, mode=mode)
    env = worker_env(run.path)
    # One intra-op thread per rank unless the user says otherwise (torchrun's default, stated).
    env.setdefault("OMP_NUM_THREADS", "1")
    console.print(f"run directory: {run.path}")
    if cfg.launcher.max_restarts and mode == "train":
        console.print(f"restarts: up to {cfg.launcher.max_restarts}; a restart resumes from the newest complete "
                      "checkpoint" + ("" if cfg.train.checkpoint_every else
                                      " [yellow](train.checkpoint_every=0: none is written, a restart starts over)[/yellow]"))
    console.print("launching: " + " ".join(cmd))
    return subprocess.run(cmd, env=env).returncode, run.path
