"""A rich progress bar for training: loss, expected τ, tokens/s, MFU (on CUDA) and ETA."""

from __future__ import annotations

from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class TrainProgress:
    def __init__(self, total: int, start: int, enabled: bool, peak_flops: float | None) -> None:
        self.enabled, self.peak_flops = enabled, peak_flops
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
            TimeRemainingColumn(), disable=not enabled,
        )
        self.task = self.progress.add_task("train", total=total, completed=start, stats="")

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
        self.progress.update(self.task, completed=step, stats=stats)

    def set_total(self, total: int) -> None:
        self.progress.update(self.task, total=total)
