"""PNG plots of a profile: time per category, and the MFU waterfall from peak to E2E."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_breakdown(report: dict, path: Path) -> None:
    plt = pyplot()
    cats = dict(report["categories_s"])
    cats["host overhead"] = report["host_overhead_s"]
    cats["data stall"] = report["data_stall_s"] if report["idle_s"] >= report["data_stall_s"] else report["idle_s"]
    names = list(cats)
    ms = [1e3 * cats[n] for n in names]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    bars = ax.barh(names[::-1], ms[::-1], color="#4C72B0")
    for bar, value in zip(bars, ms[::-1]):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {value:.1f} ms", va="center", fontsize=8)
    ax.set_xlabel("ms per step (profiled)")
    ax.set_title(f"{report['recipe']} on {report['device']}: step {1e3 * report['step_time_s']:.1f} ms", fontsize=10)
    ax.margins(x=0.2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_waterfall(report: dict, path: Path) -> None:
    plt = pyplot()
    stages = report["waterfall"]
    if not stages:
        return
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    level = 0.0
    labels = []
    for i, (name, value) in enumerate(stages):
        labels.append(name)
        if name in ("peak", "E2E MFU"):
            ax.bar(i, 100 * value, color="#55A868" if name == "E2E MFU" else "#4C72B0")
            ax.text(i, 100 * value, f"{100 * value:.1f}%", ha="center", va="bottom", fontsize=8)
            level = value
        else:
            ax.bar(i, 100 * value, bottom=100 * level, color="#C44E52")
            ax.text(i, 100 * (level + value), f"{100 * value:+.1f}", ha="center", va="top", fontsize=7)
            level += value
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("% of peak")
    ax.set_ylim(0, 110)
    ax.set_title(f"MFU waterfall, {report['recipe']} on {report['device']}\npeak {report['peak']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
