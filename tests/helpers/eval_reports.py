"""Eval reports written by hand, as `dflash-train eval` lays them out, for the readers of reports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(path: Path, block: int, rows: dict[str, dict], dtype: str = "bfloat16", batch: int = 1,
                 **extra: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"settings": {"block_size": block, "dtype": dtype, "batch_size": batch},
                                "datasets": rows, **extra}))


def result(tau: float, lossless: bool, ties: bool = False, speedup: float | None = 2.0) -> dict[str, Any]:
    """One dataset's row: 4 requests, τ̂ teacher-forced τ + 0.5, a two-bin histogram."""
    return {"requests": 4, "acceptance_length": tau, "teacher_forced_acceptance_length": tau + 0.5,
            "lossless": lossless, "lossless_requests": 4 if lossless else 3, "lossless_up_to_ties": lossless or ties,
            "divergences_at_ties": 1 if ties else 0, "speedup": speedup, "histogram": [1, 2]}


def sweep_section(temperatures: list[float], taus: dict[str, list[float]]) -> dict[str, Any]:
    """A report's `temperature_sweep` as `dflash-train eval --temperature 0,0.7,1` lays it out, from each set's τ
    at each temperature: the speedup is τ / 2, and the share of the greedy τ is τ over the first τ when the first
    temperature is 0."""
    runs = [{"temperature": t, "datasets": {name: {"acceptance_length": values[i], "speedup": values[i] / 2}
                                            for name, values in taus.items()}} for i, t in enumerate(temperatures)]
    summary = {name: {"acceptance_length": values, "acceptance_length_ci95": [None] * len(values),
                      "speedup": [tau / 2 for tau in values],
                      "fraction_of_greedy": [tau / values[0] for tau in values] if temperatures[0] == 0 else None}
               for name, values in taus.items()}
    return {"temperatures": temperatures, "summary": summary, "runs": runs}
