"""Where a kernel's warps wait, per SASS instruction: a summary of Nsight Compute's source page.

    ncu --section WarpStateStats --section SourceCounters -o rep python3 <target>
    ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv      (or | gzip > sass.csv.gz)
    python3 scripts/sass_stalls.py sass.csv [--top 12]                         ('-': standard input)

Prints the kernel's warp-stall reasons (share of all stall samples) and the instructions with the
most samples, each with how often it executed (over all warps: once per program, per item and per
tile differ by the loop it sits in) and its leading reasons. `bash scripts/gpu.sh ncu-sass` runs
it on GDPA cross-128's forward; docs/runs/2026-12-05_ncu_gdpa_cross128_stalls_h100.txt is an example.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
NEEDED = ("Address", "Source", "Instructions Executed", SAMPLES)


def _open(path: str):
    if path == "-":
        return io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8")
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rt") if gz else open(path, encoding="utf-8")


def _int(row: list, header: dict, column: str) -> int:
    text = row[header[column]].strip()
    try:
        return int(text.replace(",", "")) if text not in ("", "-") else 0
    except ValueError:
        raise ValueError(f"sass_stalls: column {column!r} at address {row[header['Address']]} holds {text!r}, "
                         "not a count") from None


def summarize(lines, top: int = 12) -> dict:
    """{'kernel', 'samples', 'instructions', 'reasons': [(reason, share)], 'top': [...]} of one
    kernel's source-page CSV (the first kernel where the file holds several). ValueError names
    the column missing when the CSV is not a SASS source page with warp-stall sampling."""
    rows = csv.reader(lines)
    kernel = header = None
    for row in rows:
        if row and row[0] == "Kernel Name":
            if kernel is not None:
                break  # the next kernel's page
            kernel = row[1] if len(row) > 1 else ""
        elif row and row[0] == "Address":
            header = {name: i for i, name in enumerate(row)}
            missing = [c for c in NEEDED if c not in header]
            if missing:
                raise ValueError(f"sass_stalls: the CSV has no column {missing[0]!r} (ncu --section WarpStateStats "
                                 "--section SourceCounters, then --page source --csv --print-source sass)")
            reasons = [c for c in header if c.startswith("stall_") and "Not Issued" not in c]
            total, per, n = collections.Counter(), [], 0
        elif header is not None and len(row) >= len(header):
            samples = _int(row, header, SAMPLES)
            n += samples
            mine = {c[6:]: _int(row, header, c) for c in reasons if _int(row, header, c)}
            total.update(mine)
            per.append((samples, row[header["Address"]], _int(row, header, "Instructions Executed"),
                        row[header["Source"]].strip(), mine))
    if header is None:
        raise ValueError("sass_stalls: no source-page table in the input (expected a row starting with 'Address')")
    n = max(n, 1)
    return {
        "kernel": kernel or "(kernel not named)", "samples": sum(p[0] for p in per), "instructions": len(per),
        "reasons": [(r, v / n) for r, v in total.most_common()],
        "top": [{"share": s / n, "address": a, "executed": e, "sass": src,
                 "reasons": sorted(m.items(), key=lambda kv: -kv[1])[:2]}
                for s, a, e, src, m in sorted(per, key=lambda p: -p[0])[:top]],
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output (.gz too; '-': stdin)")
    ap.add_argument("--top", type=int, default=12, help="instructions to list (default 12)")
    args = ap.parse_args(argv)
    if args.top < 1:
        ap.error(f"--top: at least 1, got {args.top}")  # one line, exit code 2
    try:
        with _open(args.csv) as f:
            out = summarize(f, args.top)
    except (OSError, ValueError, EOFError, csv.Error) as exc:  # UnicodeDecodeError is a ValueError
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(text if text.startswith("sass_stalls:") else f"sass_stalls: {args.csv}: {text}", file=sys.stderr)
        raise SystemExit(2)
    print(f"{out['kernel']}: {out['samples']} stall samples over {out['instructions']} SASS instructions")
    for reason, share in out["reasons"][:10]:
        print(f"  {reason:18s} {100 * share:5.1f}%")
    print("instructions with the most samples (share, address, times executed, SASS, leading reasons):")
    for t in out["top"]:
        why = ", ".join(f"{r} {v}" for r, v in t["reasons"])
        print(f"  {100 * t['share']:5.1f}% {t['address'][-5:]} x{t['executed']:<6d} {t['sass'][:64]:64s} {why}")


if __name__ == "__main__":
    main()
