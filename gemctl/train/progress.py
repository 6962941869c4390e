"""Rich progress bar for training: step, loss, QPS, Local MFU, ETA."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class TrainProgress:
    def __init__(self, total_steps: int, enabled: bool = True, console=None):
        self.enabled = enabled
        self.total = total_steps
        self._progress = None
        if enabled:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("QPS {task.fields[qps]}"),
                TextColumn("MFU {task.fields[mfu]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=console,
                transient=False,
            )
            self._task = self._progress.add_task("train", total=total_steps, loss="-", qps="-", mfu="-")

    def __enter__(self):
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.stop()

    def advance(self, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def update(self, step: int, loss: float, qps: float, mfu: float) -> None:
        if self._progress is not None:
            self._progress.update(
                self._task, completed=step, loss=f"{loss:.4f}", qps=f"{qps:,.0f}", mfu=f"{100 * mfu:.2f}%"
            )
