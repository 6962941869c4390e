"""Compare the training losses of two runs (run directories, summary.json or metrics.jsonl files,
or the golden file under tests/assets) step by step.

    python scripts/loss_compare.py runs/default/20261129-101010 runs/default/20261129-111111
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def load_losses(path: Path) -> list[float]:
    if path.is_dir():
        path = path / "summary.json"
    if path.suffix == ".jsonl":
        raise SystemExit(f"{path}: per-step losses live in summary.json (metrics.jsonl holds window means)")
    data = json.loads(path.read_text())
    if "losses" not in data:
        raise SystemExit(f"{path}: no 'losses' list")
    return [float("nan") if x is None else float(x) for x in data["losses"]]  # null: a skipped step


def _rel(x: float, y: float) -> float:
    """Relative difference; a step non-finite (skipped) in one run only differs infinitely, in both
    not at all."""
    if not (math.isfinite(x) and math.isfinite(y)):
        return 0.0 if not (math.isfinite(x) or math.isfinite(y)) else math.inf
    return abs(x - y) / max(abs(y), 1e-12)


def _mean(losses: list[float]) -> str:
    finite = [x for x in losses if math.isfinite(x)]
    skipped = len(losses) - len(finite)
    return f"{sum(finite) / max(len(finite), 1):.6f}" + (f" ({skipped} non-finite steps left out)" if skipped else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--rtol", type=float, default=1e-4, help="relative difference counted as a mismatch")
    ap.add_argument("--show", type=int, default=10, help="rows of the step table to print")
    args = ap.parse_args()
    a, b = load_losses(args.a), load_losses(args.b)
    n = min(len(a), len(b))
    if len(a) != len(b):
        print(f"note: {len(a)} vs {len(b)} steps; comparing the first {n}")
    rel = [_rel(x, y) for x, y in zip(a[:n], b[:n])]
    bad = [i for i, r in enumerate(rel) if r > args.rtol]
    print(f"{'step':>6} {'a':>12} {'b':>12} {'rel diff':>10}")
    rows = sorted(range(n), key=lambda i: -rel[i])[: args.show] if bad else range(min(n, args.show))
    for i in sorted(rows):
        print(f"{i + 1:>6} {a[i]:>12.6f} {b[i]:>12.6f} {rel[i]:>10.2e}")
    print(f"max rel diff {max(rel, default=0):.3e}; {len(bad)} of {n} steps above rtol {args.rtol:g}")
    print(f"mean loss a {_mean(a[:n])}  b {_mean(b[:n])}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
