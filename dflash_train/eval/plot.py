"""The report's figure: per dataset, the histogram of a+1 and the per-slot acceptance rates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# A bare Figure, not pyplot: no backend to choose and no global figure state, in any process.
from matplotlib.figure import Figure


def plot_report(report: dict[str, Any], path: Path) -> Path:
    rows = list(report["datasets"].items())
    fig = Figure(figsize=(10, 2.8 * len(rows)))
    axes = fig.subplots(len(rows), 2, squeeze=False)
    for (name, row), (left, right) in zip(rows, axes, strict=True):
        counts = row["histogram"]
        total = max(sum(counts), 1)
        left.bar(range(1, len(counts) + 1), [c / total for c in counts], color="tab:blue")
        tau = row["acceptance_length"]
        left.set_title(f"{name}: a+1 per cycle (τ = {tau:.2f})" if tau else f"{name}: a+1 per cycle")
        left.set_xticks(range(1, len(counts) + 1))
        left.set_xlabel("accepted drafts + bonus")
        left.set_ylabel("fraction of cycles")
        slots = range(1, len(row["per_slot_acceptance"]) + 1)
        right.plot(slots, row["per_slot_acceptance"], marker="o", label="slot accepted")
        right.plot(slots, row["per_slot_conditional_acceptance"], marker="x", label="given the previous one")
        right.set_xticks(list(slots))
        right.set_ylim(0, 1.02)
        right.set_title(f"{name}: per-slot acceptance")
        right.set_xlabel("draft slot")
        right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
