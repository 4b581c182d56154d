"""Wall-clock time of an evaluation's phases: where a run's minutes go besides the decode passes it reports
(loading, compilation and graph capture, the teacher-forced pass, prompt rendering, the report).

Phase names are paths whose first part is their group and, for decode passes, whose last part is the
engine: `load/target`, `warm_up/dflash`, `decode/humaneval/lossless_check`, `teacher_forced/mt-bench`.
Phases never overlap, so they add up to at most the run's `total`; the rest is `other`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

TOTAL = "total"
# Console labels of the groups, in the order the line shows them; a group missing from a report is left out.
GROUP_LABELS = {"load": "load", "warm_up": "warm-up", "prompts": "prompts", "teacher_forced": "teacher-forced",
                "decode": "decode", "report": "report"}
DECODE_LABELS = {"dflash": "draft", "target_only": "target", "lossless_check": "check"}


class PhaseTimer:
    """Accumulates seconds per named phase (a phase entered again adds to its time) and the run's total."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self._current: str | None = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        # A phase inside another would be counted twice in the sum the total is checked against.
        if self._current is not None:
            raise RuntimeError(f"phase {name!r} started inside phase {self._current!r}; phases must not overlap")
        self._current = name
        started = time.perf_counter()
        try:
            yield
        finally:
            _synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
            self._current = None

    def report(self) -> dict[str, float]:
        """Every phase in the order it first ran, then `total` (seconds since the timer started), 0.01 s."""
        _synchronize()
        total = time.perf_counter() - self.started
        rounded = {name: round(seconds, 2) for name, seconds in self.seconds.items()}
        # Rounded parts may add up to a few hundredths more than the rounded total they fit in.
        return {**rounded, TOTAL: round(max(total, sum(rounded.values())), 2)}


def _synchronize() -> None:
    """Wait for queued GPU work, so that a phase is charged with the kernels it launched, not the next one.
    Only where this process has started CUDA: a CPU run never initialises it for a timing."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def group_seconds(phases: dict[str, float]) -> dict[str, float]:
    """Seconds per group (the first part of each phase's name), `total` excluded."""
    groups: dict[str, float] = {}
    for name, seconds in phases.items():
        if name != TOTAL:
            group = name.split("/", 1)[0]
            groups[group] = groups.get(group, 0.0) + seconds
    return groups


def decode_seconds(phases: dict[str, float]) -> dict[str, float]:
    """Seconds of the decode passes per engine (the last part of their names), over every dataset."""
    engines: dict[str, float] = {}
    for name, seconds in phases.items():
        if name.startswith("decode/"):
            engine = name.rsplit("/", 1)[1]
            engines[engine] = engines.get(engine, 0.0) + seconds
    return engines


def _decode_parts(phases: dict[str, float]) -> list[tuple[str, float]]:
    """(label, seconds) per engine: draft, target, check first, as the speed figures read them."""
    engines = decode_seconds(phases)
    order = [e for e in DECODE_LABELS if e in engines] + [e for e in engines if e not in DECODE_LABELS]
    return [(DECODE_LABELS.get(e, e), engines[e]) for e in order]


def timing_line(report: dict[str, Any]) -> str | None:
    """`time: load 12.3 s · warm-up 61.0 s · ... · total 115.2 s`; None for a report written before phases
    were timed."""
    phases = report.get("phase_seconds")
    if not isinstance(phases, dict) or TOTAL not in phases:
        return None
    groups = group_seconds(phases)
    parts = []
    for group, label in GROUP_LABELS.items():
        if group not in groups:
            continue
        part = f"{label} {groups[group]:.1f} s"
        if group == "decode":
            part += " (" + ", ".join(f"{label} {s:.1f}" for label, s in _decode_parts(phases)) + ")"
        parts.append(part)
    unknown = sum(s for g, s in groups.items() if g not in GROUP_LABELS)
    other = phases[TOTAL] - sum(groups.values()) + unknown  # outside every phase, or in a group not listed
    if other >= 0.05:
        parts.append(f"other {other:.1f} s")
    return "time: " + " · ".join(parts + [f"total {phases[TOTAL]:.1f} s"])
