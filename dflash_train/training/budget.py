"""Wall-time limits of a run: a budget the whole schedule is fitted into, and a stop-and-resume limit.

`time_budget_minutes`: after `PROBE_STEPS` steps of this process (the first `WARM_STEPS` compile and are
not counted), the median step time fixes how many steps fit the rest of the budget, and the run (with
its cosine schedule) is shortened to that — never lengthened. Ablations that compare recipes at equal
cost use it. `stop_after_minutes`: a checkpoint is saved and the run stops once this much time has passed
in this process (a job's time limit); the same command resumes it, with the length already settled.
"""

from __future__ import annotations

import statistics
import time

WARM_STEPS = 3
PROBE_STEPS = 12
MARGIN = 0.95  # validation, checkpoints and slower steps later on


class TimeBudget:
    def __init__(self, total_minutes: float | None, stop_after_minutes: float | None) -> None:
        self.total_minutes, self.stop_after_minutes = total_minutes, stop_after_minutes
        self.earlier_seconds = 0.0  # spent by the processes this run resumed from
        self.sized = False
        self._started: float | None = None
        self._steps: list[float] = []

    def start(self) -> None:
        self._started = time.monotonic()

    def resume(self, earlier_seconds: float, sized: bool) -> None:
        self.earlier_seconds, self.sized = earlier_seconds, sized

    def this_process(self) -> float:
        return 0.0 if self._started is None else time.monotonic() - self._started

    def elapsed(self) -> float:
        return self.earlier_seconds + self.this_process()

    def observe(self, step_seconds: float, step: int, total_steps: int) -> int | None:
        """Record one step; returns the run's new length on the step that settles it, else None."""
        if self.total_minutes is None or self.sized:
            return None
        self._steps.append(step_seconds)
        if len(self._steps) < PROBE_STEPS and step < total_steps:
            return None
        self.sized = True
        per_step = statistics.median(self._steps[WARM_STEPS:] or self._steps)
        remaining = self.total_minutes * 60 - self.elapsed()
        return max(step, min(total_steps, step + int(MARGIN * remaining / per_step)))

    def should_stop(self) -> bool:
        return self.stop_after_minutes is not None and self.this_process() >= self.stop_after_minutes * 60
