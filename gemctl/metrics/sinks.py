"""Where results go: a run directory with the resolved config, a JSONL metrics log, a summary."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class RunDir:
    path: Path

    @classmethod
    def create(cls, root: str | os.PathLike, name: str, prefix: str = "") -> "RunDir":
        """runs/<name>/<prefix><timestamp>[-k]: a fresh directory per run, also for runs started in
        the same second (the mkdir that fails on an existing directory decides, not a check first)."""
        stamp = prefix + time.strftime("%Y%m%d-%H%M%S")
        base = Path(root) / name / stamp
        path, k = base, 1
        while True:
            try:
                path.mkdir(parents=True, exist_ok=False)
                return cls(path)
            except FileExistsError:
                k += 1
                path = base.with_name(f"{stamp}-{k}")

    def write_text(self, name: str, text: str) -> Path:
        """Write atomically (temporary file, then rename)."""
        target = self.path / name
        tmp = target.with_suffix(target.suffix + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, target)
        return target


class JsonlSink:
    """Appends one JSON record per line; with no path (ranks other than 0) it writes nothing."""

    def __init__(self, path: Path | None):
        self._f = open(path, "a", buffering=1) if path is not None else None

    def write(self, record: dict) -> None:
        if self._f is not None:
            self._f.write(json.dumps(record, default=float) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
