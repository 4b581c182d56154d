"""A rich progress bar for training: loss, expected τ, tokens/s, MFU (on CUDA) and ETA."""

from __future__ import annotations

import time
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class TrainProgress:
    """A live bar on a terminal; one plain line every `log_every` steps where output goes to a file (a job
    log shows progress as it happens, not only when the run ends)."""

    def __init__(self, total: int, start: int, enabled: bool, peak_flops: float | None, log_every: int = 10) -> None:
        self.enabled, self.peak_flops, self.log_every = enabled, peak_flops, max(1, log_every)
        self.started = time.monotonic()
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
            TimeRemainingColumn(), disable=not enabled,
        )
        self.task = self.progress.add_task("train", total=total, completed=start, stats="")
        self.plain = enabled and not self.progress.console.is_terminal

    def __enter__(self) -> TrainProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def update(self, step: int, metrics: dict[str, Any], seconds: float) -> None:
        stats = (f"loss {metrics['loss']:.3f}  τ̂ {metrics['expected_acceptance_length']:.2f}  "
                 f"{metrics['tokens'] / seconds:,.0f} tok/s")
        if self.peak_flops:
            stats += f"  MFU {100 * metrics['flops'] / seconds / self.peak_flops:.1f}%"
            if metrics.get("step_flops", 0) > metrics["flops"]:  # the target's pass ran in the step
                stats += f" (step {100 * metrics['step_flops'] / seconds / self.peak_flops:.1f}%)"
        self.progress.update(self.task, completed=step, stats=stats)
        total = self.progress.tasks[0].total
        if self.plain and (step % self.log_every == 0 or step == total):
            print(f"train step {step}/{total:.0f}  {stats}  ({time.monotonic() - self.started:.0f} s)", flush=True)

    def advance(self, step: int) -> None:
        """A step whose metrics were not waited for: the bar moves, its figures stay the last known."""
        self.progress.update(self.task, completed=step)

    def set_total(self, total: int) -> None:
        self.progress.update(self.task, total=total)
