"""curves.png of a training run: the loss of every step, Local MFU of each logged window, and the
eval NE of each evaluation (train.eval_every), from what the run already records."""

from __future__ import annotations

import math
from pathlib import Path


def plot_curves(losses: list[float | None], records: list[dict], path: Path, title: str, first_step: int = 1) -> Path:
    """``losses``: one per step from ``first_step`` on (non-finite ones left out); ``records``: the
    run's metrics.jsonl rows
    ("train" windows: step, loss, local_mfu or e2e_mfu, step_time_ms; "eval": step and per-task
    {"ne": ...})."""
    from gemctl.profile.plots import pyplot

    plt = pyplot()
    windows = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    panels = 3 if evals else 2
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.6), dpi=110)
    ax = axes[0]
    kept = [(first_step + i, x) for i, x in enumerate(losses) if x is not None and math.isfinite(x)]
    ax.plot([s for s, _ in kept], [x for _, x in kept], lw=0.8, color="#4C72B0", label="step")
    ax.plot([w["step"] for w in windows], [w["loss"] for w in windows], "o-", ms=3, color="#C44E52",
            label="window mean")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=7)
    ax = axes[1]
    mfu = [(w["step"], w["local_mfu"] if w.get("local_mfu") is not None else w.get("e2e_mfu")) for w in windows]
    mfu = [(s, m) for s, m in mfu if m is not None]
    ax.plot([s for s, _ in mfu], [100 * m for _, m in mfu], "o-", ms=3, color="#55A868")
    ax.set_xlabel("step (end of window)")
    ax.set_ylabel("MFU (%)")
    ax.set_ylim(bottom=0)
    if evals:
        ax = axes[2]
        tasks = [k for k, v in evals[-1].items() if isinstance(v, dict) and "ne" in v]
        for task in tasks:
            ax.plot([e["step"] for e in evals], [e[task]["ne"] for e in evals], "o-", ms=3, label=task)
        ax.set_xlabel("step")
        ax.set_ylabel("eval NE")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
