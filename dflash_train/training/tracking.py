"""Where training metrics go: a JSONL file (always), wandb (optional), and a PNG at the end."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from dflash_train.training.config import TrackingConfig


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def wandb_mode(config: TrackingConfig) -> str:
    if config.wandb_mode != "auto":
        return config.wandb_mode
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path.home() / ".netrc"
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return "online"
    return "offline"


class MetricsLogger:
    """Main-process only. JSONL lines are `{"step": n, "split": "train"|"validation", ...}`."""

    def __init__(self, output_dir: Path, tracking: TrackingConfig, run_config: dict[str, Any]) -> None:
        self.path = output_dir / "metrics.jsonl"
        self.run = None
        if tracking.report_to == "wandb":
            try:
                import wandb  # only runs that report to wandb pay for its import (a quarter second)
            except ImportError as error:
                raise ValueError("tracking.report_to=wandb needs `pip install wandb` (or set report_to: none)") from error
            self.run = wandb.init(
                project=tracking.project, name=tracking.run_name, dir=str(output_dir),
                config={**run_config, "git_commit": git_commit()}, mode=wandb_mode(tracking), resume="allow",
            )

    def log(self, step: int, split: str, values: dict[str, Any]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps({"step": step, "split": split, **values}) + "\n")
        if self.run is not None:
            self.run.log(flatten(split, values), step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()


def flatten(prefix: str, values: dict[str, Any]) -> dict[str, Any]:
    """wandb keys: `validation/loss`, lists as `validation/slot_accuracy_1`..., a mapping one level down
    (`by_source`: `validation/<source>/expected_acceptance_length`), so every source gets its own chart."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, list):
            flat.update({f"{prefix}/{key}_{i + 1}": v for i, v in enumerate(value)})
        elif isinstance(value, dict):
            for name, inner in value.items():
                flat.update(flatten(f"{prefix}/{name}", inner))
        else:
            flat[f"{prefix}/{key}"] = value
    return flat


def read_metrics(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The last record per (split, step): a resumed run re-logs the steps after its checkpoint."""
    latest: dict[tuple[str, int], dict[str, Any]] = {}
    for line in path.read_bytes().split(b"\n"):  # newlines only: str.splitlines() splits at U+2028 too
        if not line.strip():
            continue
        record = json.loads(line)
        latest[(record["split"], record["step"])] = record
    out: dict[str, list[dict[str, Any]]] = {}
    for (split, _), record in sorted(latest.items(), key=lambda item: (item[0][0], item[0][1])):
        out.setdefault(split, []).append(record)
    return out


def source_curves(records: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """Per-source validation τ̂: source -> (steps, τ̂); empty for files written without `by_source`."""
    curves: dict[str, tuple[list[int], list[float]]] = {}
    for record in records:
        for name, values in record.get("by_source", {}).items():
            steps, taus = curves.setdefault(name, ([], []))
            steps.append(record["step"])
            taus.append(values["expected_acceptance_length"])
    return curves


def plot_metrics(metrics_path: Path, out_path: Path) -> Path:
    # Imported here, not with the module: matplotlib takes most of a second to import, which every training
    # process (each rank of a launch) paid at its start. A bare Figure, not pyplot: no backend to choose and no
    # global figure state.
    from matplotlib.figure import Figure

    metrics = read_metrics(metrics_path)
    fig = Figure(figsize=(17, 4))
    axes = fig.subplots(1, 3)
    for split, style in (("train", "-"), ("validation", "o-")):
        records = metrics.get(split, [])
        if not records:
            continue
        steps = [r["step"] for r in records]
        axes[0].plot(steps, [r["loss"] for r in records], style, label=split)
        axes[1].plot(steps, [r["mean_slot_accuracy"] for r in records], style, label=split)
        axes[2].plot(steps, [r["expected_acceptance_length"] for r in records], style, label=split)
    for name, (steps, taus) in source_curves(metrics.get("validation", [])).items():
        axes[2].plot(steps, taus, "o--", markersize=3, linewidth=1, label=f"validation: {name}")
    # Log scale: the first steps' loss (60+ under D-PACE) would otherwise flatten the rest of the curve.
    axes[0].set_yscale("log")
    # Fixed legend corners where the curves rarely are (matplotlib's "best" searches, slowly on long runs).
    titles = ("loss (log scale)", "mean per-slot top-1 accuracy", "expected acceptance length τ")
    for ax, title, corner in zip(axes, titles, ("upper right", "lower right", "upper left"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3, which="both")
        # τ's legend (one line per data source) goes beside its panel, where it hides no curve.
        outside = {"bbox_to_anchor": (1.02, 1.0)} if ax is axes[2] else {}
        ax.legend(fontsize="small", loc=corner, framealpha=0.8, **outside)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    return out_path
