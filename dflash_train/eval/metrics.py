"""Acceptance-length statistics (docs/design.md §5).

Each cycle yields one sample a+1 (accepted drafts plus the bonus token, 1..B). Reported:
- `acceptance_length` (τ): mean over requests of each request's mean a+1 (each turn is a request), as
  published DFlash benchmarks compute it;
- `acceptance_length_ci95`: the 95 % percentile-bootstrap interval of τ over requests (uncertainty.py; None
  for fewer than two requests);
- `acceptance_length_cycle_weighted`: mean of a+1 over all cycles;
- `histogram`: counts of a+1 = 1..B over all cycles;
- `per_slot_acceptance[k-1]`: fraction of cycles whose draft slot k was accepted (a >= k), k = 1..B-1;
- `per_slot_conditional_acceptance[k-1]`: P(a >= k | a >= k-1), the rate of slot k given it was reached.
Requests with no cycle (first token was a stop token, or one new token) do not count toward τ.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import fmean
from typing import Any

from dflash_train.eval.uncertainty import mean_interval


def acceptance_metrics(per_request: Sequence[Sequence[int]], block_size: int) -> dict[str, Any]:
    requests = [list(r) for r in per_request if r]
    cycles = [a for r in requests for a in r]
    if any(not 1 <= a <= block_size for a in cycles):
        raise AssertionError(f"acceptance lengths must lie in 1..{block_size}")
    histogram = [sum(1 for a in cycles if a == value) for value in range(1, block_size + 1)]
    reached = [sum(1 for a in cycles if a >= k) for k in range(1, block_size + 1)]  # cycles with a+1 >= k
    per_slot = [reached[k] / len(cycles) if cycles else 0.0 for k in range(1, block_size)]
    conditional = [reached[k] / reached[k - 1] if reached[k - 1] else 0.0 for k in range(1, block_size)]
    request_means = [fmean(r) for r in requests]
    return {
        "acceptance_length": fmean(request_means) if requests else None,
        "acceptance_length_ci95": mean_interval(request_means),
        "acceptance_length_cycle_weighted": fmean(cycles) if cycles else None,
        "histogram": histogram,
        "per_slot_acceptance": per_slot,
        "per_slot_conditional_acceptance": conditional,
        "requests_with_cycles": len(requests),
        "cycles": len(cycles),
    }


def running_tau(per_request: Sequence[Sequence[int]]) -> float | None:
    requests = [r for r in per_request if r]
    return fmean(fmean(r) for r in requests) if requests else None
