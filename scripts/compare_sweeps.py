"""Side by side: kernel sweeps of several trees or cards (the JSONs of bench_block_attention.py
--sweep and bench_gdpa.py --grid-only, which gpu.sh's A/B stages write).

    python3 scripts/compare_sweeps.py \\
        --group "proxy ring=out/proxy_block_this_1.json,out/proxy_block_this_2.json" \\
        --group "H200 ring=docs/runs/2026-12-06_sweep_block_bwd_ring_1_h200.json,docs/runs/2026-12-06_sweep_block_bwd_ring_2_h200.json"

Each group is LABEL=FILE[,FILE...] (the rounds of one setting); a row per (workload, dim, kind,
config) present in any group, each group's mean time (us) and mean share of its roofline over its
rounds, and the groups' GPUs under the table. With --ratio A/B (two labels) a column says how much
faster A is than B. A file that is missing or not a sweep: one line naming it, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _fail(message: str) -> None:
    print(f"compare_sweeps: {message}", file=sys.stderr)
    raise SystemExit(2)


def _rows(doc: dict) -> list[dict]:
    """The timed rows of a sweep file: bench_block_attention's 'sweep' list as it is; bench_gdpa
    --grid-only's 'rows', one per config of each workload's 'grid_sweep' (the forward's graph time,
    and its TF/s as a share of the workload's roofline)."""
    if isinstance(doc.get("sweep"), list):
        return doc["sweep"]
    if isinstance(doc.get("rows"), list):
        return [{"workload": r["workload"], "kind": "fwd", "cfg": g["config"], "ms": g["fwd_graph_ms"],
                 "pct": 100 * g["fwd_graph_tflops"] / r["roofline_tflops"]}
                for r in doc["rows"] for g in r.get("grid_sweep", []) if "fwd_graph_ms" in g]  # not a failed config
    raise KeyError("no 'sweep' or 'rows' list")


def load_group(spec: str) -> tuple[str, dict, list[str]]:
    """(label, {row key: (mean ms, mean pct, rounds)}, GPUs) of one LABEL=FILE[,FILE...] group."""
    label, sep, files = spec.partition("=")
    if not sep or not label.strip() or not files.strip():
        _fail(f"--group takes LABEL=FILE[,FILE...], got {spec!r}")
    sums: dict[tuple, list] = {}
    gpus = []
    for name in files.split(","):
        path = Path(name.strip())
        try:
            doc = json.loads(path.read_text())
            rows = _rows(doc)
        except (OSError, ValueError, KeyError) as exc:
            _fail(f"{path}: not a sweep file ({type(exc).__name__}: {exc})")
        gpu = doc.get("meta", {}).get("gpu", "?")
        if gpu not in gpus:
            gpus.append(gpu)
        for r in rows:
            if "ms" not in r or "workload" not in r:
                continue
            cfg = tuple(r.get("cfg") or r.get("config") or ())
            key = (r["workload"], r.get("dim", ""), r.get("kind", r.get("pass", "")), cfg)
            acc = sums.setdefault(key, [0.0, 0.0, 0])
            acc[0] += r["ms"]
            acc[1] += r.get("pct", float("nan"))
            acc[2] += 1
    return label.strip(), {k: (s / n, p / n, n) for k, (s, p, n) in sums.items()}, gpus


def table(groups: list[tuple[str, dict, list[str]]], ratio: tuple[str, str] | None = None) -> str:
    keys = []
    for _, rows, _ in groups:
        keys += [k for k in rows if k not in keys]
    head = ["workload", "D", "kind", "config"] + [g[0] for g in groups] + ([f"{ratio[0]} vs {ratio[1]}"] if ratio else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by_label = {g[0]: g[1] for g in groups}
    for key in keys:
        cells = [str(key[0]), str(key[1]), str(key[2]), ",".join(map(str, key[3]))]
        for _, rows, _ in groups:
            ms, pct, n = rows.get(key, (None, None, 0))
            cells.append("-" if ms is None else f"{ms * 1e3:.1f} us, {pct:.1f}% ({n})")
        if ratio:
            a, b = by_label[ratio[0]].get(key), by_label[ratio[1]].get(key)
            cells.append(f"{b[0] / a[0]:.3f}x" if a and b else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"{label}: {', '.join(gpus)}" for label, _, gpus in groups]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--group", action="append", required=True, metavar="LABEL=FILE[,FILE...]")
    ap.add_argument("--ratio", metavar="A/B", help="a column: B's time over A's (how much faster A is)")
    args = ap.parse_args(argv)
    groups = [load_group(g) for g in args.group]
    ratio = None
    if args.ratio:
        a, sep, b = args.ratio.partition("/")
        labels = [g[0] for g in groups]
        if not sep or a not in labels or b not in labels:
            _fail(f"--ratio takes A/B with two of the labels {labels}, got {args.ratio!r}")
        ratio = (a, b)
    print(table(groups, ratio))


if __name__ == "__main__":
    main()
