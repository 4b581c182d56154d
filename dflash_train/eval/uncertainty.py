"""How sure a τ is: percentile-bootstrap intervals over an eval's requests.

τ is a mean over requests, and an eval set holds tens of them, so two runs 0.1 apart may not differ at all.
`mean_interval` resamples the requests (each request's own mean a+1) with replacement; `paired_difference`
does the same for two drafters on the same requests, resampling the per-request differences, which is far
tighter than comparing two independent intervals because the hard prompts are hard for both. Seeded, so a
report's interval is the same every time it is computed.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95


def mean_interval(values: Sequence[float], level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0
                  ) -> tuple[float, float] | None:
    """The `level` percentile-bootstrap interval of the mean of `values`; None for fewer than two values."""
    data = np.asarray(values, dtype=np.float64)
    if data.size < 2:
        return None
    rng = np.random.default_rng(seed)
    # Resampled in chunks of about a million draws: a large eval set's [resamples, n] indices stay small.
    chunk = max(1, min(resamples, (1 << 20) // data.size))
    means = np.concatenate([data[rng.integers(0, data.size, size=(min(chunk, resamples - done), data.size))].mean(1)
                            for done in range(0, resamples, chunk)])
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(low), float(high)


def paired_difference(candidate: Mapping[Hashable, float], baseline: Mapping[Hashable, float],
                      level: float = LEVEL) -> dict[str, Any] | None:
    """Mean of candidate − baseline over the keys both measured, with its bootstrap interval; None without
    two shared keys. Keys are requests (e.g. (conversation, turn)); a key one side lacks is left out."""
    shared = [key for key in candidate if key in baseline]
    if len(shared) < 2:
        return None
    differences = [candidate[key] - baseline[key] for key in shared]
    return {"requests": len(shared), "mean": float(np.mean(differences)),
            "ci95": mean_interval(differences, level)}


def format_interval(bounds: Sequence[float] | None) -> str:
    """`3.95–4.31`, or `—` without an interval (a report from before intervals, or one request)."""
    return "—" if bounds is None else f"{bounds[0]:.2f}–{bounds[1]:.2f}"


def format_difference(difference: dict[str, Any] | None) -> str:
    """`+0.14 (+0.03…+0.25)`, with `*` when the interval excludes 0; `—` without a difference."""
    if difference is None:
        return "—"
    text = f"{difference['mean']:+.2f}"
    if difference["ci95"] is None:
        return text
    low, high = difference["ci95"]
    marker = "*" if low > 0 or high < 0 else ""
    return f"{text} ({low:+.2f}…{high:+.2f}){marker}"
