"""Wall-time limits of a run: a budget the whole schedule is fitted into, and a stop-and-resume limit.

`time_budget_minutes`: after `PROBE_STEPS` steps of this process (the first `WARM_STEPS` compile and are
not counted), the median step time fixes how many steps fit the rest of the budget, and the run (with
its cosine schedule) is shortened to that — never beyond its configured length. Every `REFIT_STEPS`
steps the fit is redone from the recent median and applied when it moves the end by more than
`REFIT_TOLERANCE` of the remaining steps: a run that shares its GPU with others speeds up once they
finish (and slows down when one starts), and should still end on time. The cosine schedule follows the
new length from that step on.

With `exclude_warmup` the budget's clock starts once the `WARM_STEPS` compiling steps are done: runs that
compare recipes at equal minutes then get equal minutes of training, whichever of them found the compiled
graphs already cached (otherwise a fresh shape compiles for a third of a short ablation's minutes:
docs/results.md, 'The recipe's first ablations').

`stop_after_minutes`: a checkpoint is saved and the run stops once this much time has passed in this
process (a job's time limit); the same command resumes it, with the length already settled.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

WARM_STEPS = 3
PROBE_STEPS = 12
REFIT_STEPS = 50
REFIT_TOLERANCE = 0.15
MARGIN = 0.95  # validation, checkpoints and slower steps later on


class TimeBudget:
    def __init__(self, total_minutes: float | None, stop_after_minutes: float | None,
                 exclude_warmup: bool = False) -> None:
        self.total_minutes, self.stop_after_minutes = total_minutes, stop_after_minutes
        self.exclude_warmup = exclude_warmup
        self.earlier_seconds = 0.0  # spent by the processes this run resumed from
        self.sized = False
        self._started: float | None = None
        self._steps: list[float] = []  # the probe
        self._recent: deque[float] = deque(maxlen=REFIT_STEPS)

    def start(self) -> None:
        self._started = time.monotonic()

    def resume(self, earlier_seconds: float, sized: bool) -> None:
        self.earlier_seconds, self.sized = earlier_seconds, sized

    def this_process(self) -> float:
        return 0.0 if self._started is None else time.monotonic() - self._started

    def elapsed(self) -> float:
        return self.earlier_seconds + self.this_process()

    def observe(self, step_seconds: float, step: int, total_steps: int, limit: int | None = None) -> int | None:
        """Record one step; returns the fitted length on the steps that fit it (the same steps on every rank:
        the end of the probe, then every REFIT_STEPS), else None. `limit` is the configured length (epochs
        or max_steps): the budget never makes the run longer than that. Whether a refit is applied is
        `worth_refitting`'s call, made on the value the ranks agreed on."""
        if self.total_minutes is None:
            return None
        limit = total_steps if limit is None else limit
        if self.sized:
            self._recent.append(step_seconds)
            if len(self._recent) < REFIT_STEPS:
                return None
            new_total = self._fit(statistics.median(self._recent), step, limit)
            self._recent.clear()
            return new_total
        self._steps.append(step_seconds)
        if self.exclude_warmup and len(self._steps) == WARM_STEPS:
            self.start()  # the compiling steps are not part of the budget
        if len(self._steps) < PROBE_STEPS and step < total_steps:
            return None
        self.sized = True
        return self._fit(statistics.median(self._steps[WARM_STEPS:] or self._steps), step, min(total_steps, limit))

    @staticmethod
    def worth_refitting(new_total: int, total_steps: int, step: int) -> bool:
        """A refit moves the end of the run (and its schedule) only for a real change of speed."""
        return abs(new_total - total_steps) > REFIT_TOLERANCE * max(1, total_steps - step)

    def _fit(self, per_step: float, step: int, limit: int) -> int:
        remaining = self.total_minutes * 60 - self.elapsed()  # type: ignore[operator]
        return max(step, min(limit, step + int(MARGIN * remaining / per_step)))

    def should_stop(self) -> bool:
        return self.stop_after_minutes is not None and self.this_process() >= self.stop_after_minutes * 60
