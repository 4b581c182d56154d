"""Training runs side by side: each run's last validation, overall and per data source, with its steps and
minutes.

    python -m dflash_train.training.compare outputs/speedrun/train/ablation-*     # prints a Markdown table

An ablation at equal GPU-minutes is a few runs on the same prepared data (so the same validation split), one
setting changed in each, each with the same wall-time budget; this table judges them by held-out τ̂ before
any decoding eval (the speedrun's `ablate` stage prints it). τ̂ per source shows which kind of data a change
helps: a mix's easy sources can hide a loss on the chat or code a user serves.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from dflash_train.training.tracking import read_metrics


def run_row(run_dir: Path) -> dict[str, Any] | None:
    """The run's last validation record, or None when it has not validated yet."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None
    validation = read_metrics(metrics).get("validation", [])
    if not validation:
        return None
    last = validation[-1]
    states = sorted(run_dir.glob("checkpoints/step-*/trainer_state.json"))
    seconds = json.loads(states[-1].read_text()).get("train_seconds") if states else None
    return {
        "run": run_dir.name, "step": last["step"], "train_minutes": None if seconds is None else round(seconds / 60, 1),
        "loss": last["loss"], "tau_hat": last["expected_acceptance_length"],
        "by_source": {name: values["expected_acceptance_length"] for name, values in last.get("by_source", {}).items()},
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    sources = sorted({name for row in rows for name in row["by_source"]})
    header = ["run", "step", "train min", "val loss", "val τ̂", *(f"τ̂ {name}" for name in sources)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        per_source = [f"{row['by_source'][name]:.2f}" if name in row["by_source"] else "—" for name in sources]
        minutes = "—" if row["train_minutes"] is None else str(row["train_minutes"])
        lines.append("| " + " | ".join([row["run"], str(row["step"]), minutes, f"{row['loss']:.3f}",
                                        f"{row['tau_hat']:.2f}", *per_source]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m dflash_train.training.compare RUN_DIR [RUN_DIR ...]", file=sys.stderr)
        return 2
    rows = [row for row in (run_row(Path(arg)) for arg in args) if row is not None]
    if not rows:
        print(f"compare: none of {len(args)} run folders has a validation in its metrics.jsonl; train them with "
              "training.eval_every below their length", file=sys.stderr)
        return 1
    print(markdown(rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
