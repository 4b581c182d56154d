"""The report's figure: per dataset, the histogram of a+1 and the per-slot acceptance rates; with a temperature
sweep, a third panel of τ and speedup against temperature."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def plot_report(report: dict[str, Any], path: Path) -> Path:
    # Imported here, not with the module: matplotlib takes most of a second to import, which every eval paid
    # whether or not it drew. A bare Figure, not pyplot: no backend to choose and no global figure state.
    from matplotlib.figure import Figure

    rows = list(report["datasets"].items())
    sweep = report.get("temperature_sweep")
    columns = 3 if sweep else 2
    fig = Figure(figsize=(5 * columns, 2.8 * len(rows)))
    axes = fig.subplots(len(rows), columns, squeeze=False)
    # In a sweep the first two panels are the lowest temperature's, which the title says.
    at = f" at T={report['settings']['temperature']:g}" if sweep else ""
    for (name, row), panels in zip(rows, axes, strict=True):
        _histogram(panels[0], f"{name}{at}", row)
        _per_slot(panels[1], f"{name}{at}", row)
        if sweep:
            _against_temperature(panels[2], name, sweep["temperatures"], sweep["summary"][name])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _histogram(ax: Axes, name: str, row: dict[str, Any]) -> None:
    counts = row["histogram"]
    total = max(sum(counts), 1)
    ax.bar(range(1, len(counts) + 1), [c / total for c in counts], color="tab:blue")
    tau = row["acceptance_length"]
    ax.set_title(f"{name}: a+1 per cycle (τ = {tau:.2f})" if tau else f"{name}: a+1 per cycle")
    ax.set_xticks(range(1, len(counts) + 1))
    ax.set_xlabel("accepted drafts + bonus")
    ax.set_ylabel("fraction of cycles")


def _per_slot(ax: Axes, name: str, row: dict[str, Any]) -> None:
    slots = range(1, len(row["per_slot_acceptance"]) + 1)
    ax.plot(slots, row["per_slot_acceptance"], marker="o", label="slot accepted")
    ax.plot(slots, row["per_slot_conditional_acceptance"], marker="x", label="given the previous one")
    ax.set_xticks(list(slots))
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{name}: per-slot acceptance")
    ax.set_xlabel("draft slot")
    ax.legend(fontsize=8)


def _against_temperature(ax: Axes, name: str, temperatures: list[float], summary: dict[str, Any]) -> None:
    """τ (left axis) and speedup (right axis) at each temperature; a missing figure (no cycle, no timing) is a gap."""
    taus = [float("nan") if tau is None else tau for tau in summary["acceptance_length"]]
    ax.plot(temperatures, taus, marker="o", color="tab:blue", label="τ")
    ax.set_xticks(temperatures)
    ax.set_xlabel("temperature")
    ax.set_ylabel("τ (acceptance length)", color="tab:blue")
    ax.set_title(f"{name}: τ and speedup against temperature")
    speedups = [float("nan") if s is None else s for s in summary["speedup"]]
    right = ax.twinx()
    right.plot(temperatures, speedups, marker="s", linestyle="--", color="tab:orange", label="speedup")
    right.set_ylabel("speedup (×)", color="tab:orange")
