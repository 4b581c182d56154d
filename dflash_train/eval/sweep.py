"""τ against temperature: the report's `temperature_sweep` section (`dflash-train eval --temperature 0,0.7,1`).

Each temperature is a whole evaluation of the same prompt sets with the same seed. The report's own
`datasets` and `settings.temperature` stay those of the lowest temperature, so every reader of a
single-temperature report reads a sweep's as one; the section beside them holds every temperature's results
and, per prompt set, the figures a plot or a table of τ against temperature needs:

    "temperature_sweep": {
        "temperatures": [0.0, 0.7, 1.0],
        "summary": {"humaneval": {"acceptance_length": [...], "acceptance_length_ci95": [...],
                                  "speedup": [...], "fraction_of_greedy": [...] or null}},
        "runs": [{"temperature": 0.0, "datasets": {...}}, ...]
    }
"""

from __future__ import annotations

from typing import Any, NamedTuple

SWEEP_DEFINITIONS: dict[str, str] = {
    "temperature_sweep": "the same prompt sets decoded with the same seed at each temperature of --temperature, "
                         "in increasing order; the report's datasets and settings.temperature are the lowest's",
    "fraction_of_greedy": "acceptance_length at a temperature over acceptance_length at temperature 0 (null "
                          "without 0 in the sweep): how much of the greedy τ sampling keeps",
}


class SweepRun(NamedTuple):
    temperature: float
    datasets: dict[str, dict[str, Any]]  # results per prompt set, as the report's `datasets`


def sweep_section(runs: list[SweepRun]) -> dict[str, Any]:
    """The report's `temperature_sweep` from the runs in increasing temperature (two or more)."""
    return {
        "temperatures": [run.temperature for run in runs],
        "summary": {name: _set_summary(runs, name) for name in runs[0].datasets},
        "runs": [{"temperature": run.temperature, "datasets": run.datasets} for run in runs],
    }


def _set_summary(runs: list[SweepRun], name: str) -> dict[str, Any]:
    """One prompt set's τ, its interval and the speedup at each temperature, and τ as a share of the greedy τ."""
    taus = [run.datasets[name]["acceptance_length"] for run in runs]
    greedy = taus[0] if runs[0].temperature == 0 else None
    return {
        "acceptance_length": taus,
        "acceptance_length_ci95": [run.datasets[name].get("acceptance_length_ci95") for run in runs],
        "speedup": [run.datasets[name]["speedup"] for run in runs],
        "fraction_of_greedy": [tau / greedy if tau is not None else None for tau in taus] if greedy else None,
    }
