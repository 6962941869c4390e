"""The sample ledger: which samples every step trained on, on every rank, across restarts.

With ``train.sample_ledger=true`` each rank appends one JSON line per trained step to
``<run directory>/samples/rank<r>.jsonl``: ``{"step", "attempt", "pid", "ids"}`` (``attempt`` is
torchrun's restart count, ``pid`` the worker process). The ids come from the batch's host copy,
so the ledger costs no device sync.

A restarted attempt resumes from the last complete checkpoint and trains the steps after it
again; the updates of the earlier attempt past that checkpoint were lost with its process. The
history that produced the final model is therefore, for every (rank, step), the entry of the
latest attempt: :func:`history` rebuilds it, :func:`account` compares it with an uninterrupted
run's (samples lost, samples duplicated, steps that trained on different samples).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path


def restart_count() -> int:
    """How many times torchrun has restarted this worker group (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class SampleLedger:
    """One rank's ledger file, appended line by line (a killed process loses at most the line
    being written; :func:`read` skips a torn last line)."""

    def __init__(self, run_dir: Path, rank: int):
        path = Path(run_dir) / "samples"
        path.mkdir(parents=True, exist_ok=True)
        self._f = open(path / f"rank{rank}.jsonl", "a", buffering=1)
        self._attempt, self._pid = restart_count(), os.getpid()

    def write(self, step: int, ids) -> None:
        """``step``: 1-based number of the step just trained; ``ids``: its samples (host tensor)."""
        self._f.write(json.dumps({"step": step, "attempt": self._attempt, "pid": self._pid, "ids": ids.tolist()}) + "\n")

    def close(self) -> None:
        self._f.close()


def read(run_dir: Path) -> dict[int, list[dict]]:
    """rank -> the ledger lines of that rank in file order (a torn last line is dropped)."""
    out = {}
    for path in sorted((Path(run_dir) / "samples").glob("rank*.jsonl")):
        lines = []
        for line in path.read_text().splitlines():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:  # the line a killed process was writing
                continue
        out[int(path.stem[4:])] = lines
    return out


def history(run_dir: Path) -> dict[tuple[int, int], list[int]]:
    """(rank, step) -> sample ids of the attempt whose update the final model kept (the latest)."""
    best: dict[tuple[int, int], tuple[int, list[int]]] = {}
    for rank, lines in read(run_dir).items():
        for rec in lines:
            key = (rank, rec["step"])
            if key not in best or rec["attempt"] >= best[key][0]:
                best[key] = (rec["attempt"], rec["ids"])
    return {key: ids for key, (_, ids) in sorted(best.items())}


def attempts(run_dir: Path) -> int:
    """Number of attempts that trained at least one step."""
    seen = {rec["attempt"] for lines in read(run_dir).values() for rec in lines}
    return len(seen)


def account(run_dir: Path, reference_dir: Path) -> dict:
    """Compare a run's effective history with an uninterrupted reference run's.

    lost: samples the reference trained on that the run's final history does not contain;
    duplicated: samples the run's history contains more often than the reference's;
    mismatched_steps: (rank, step) pairs whose samples differ (order included).
    """
    got, want = history(run_dir), history(reference_dir)
    c_got = Counter(i for ids in got.values() for i in ids)
    c_want = Counter(i for ids in want.values() for i in ids)
    return {
        "steps": len(got),
        "samples": sum(c_got.values()),
        "lost": sum((c_want - c_got).values()),
        "duplicated": sum((c_got - c_want).values()),
        "mismatched_steps": sorted(set(got) ^ set(want)) + sorted(k for k in set(got) & set(want) if got[k] != want[k]),
        "attempts": attempts(run_dir),
    }
