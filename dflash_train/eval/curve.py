"""τ against training minutes: what more GPU time buys, from a recipe run directory's eval reports.

    python -m dflash_train.eval.curve outputs/speedrun     # prints a table, writes curve.json and curve.png
    python -m dflash_train.eval.curve runs/a runs/b        # points of several run directories, written to the first

Each training run under `<run>/train/<name>` that has an eval report `<run>/eval/<name>[-b16|-b8].json` at
batch 1 (a `-fp32` check excepted) is one point per dataset: its training minutes (from the last
checkpoint's trainer state) against the report's τ and speedup. Runs trained for different budgets, each
with its own schedule (the speedrun's `curve` stage), make the curve; a run continued with resume is one
point at its total minutes. Runs trained on other machines or days (the same data, another budget) join
the curve from their own directories; with more than one directory a point's run is named `dir/run`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from dflash_train.eval.summary import summary_rows


def curve_points(run_dir: Path) -> list[dict[str, Any]]:
    """One point per (run, dataset), sorted by training minutes: batch-1 reports other than a `-fp32`
    check (a float32 repeat checks losslessness; its speed is not the one a user gets), at the largest block
    evaluated (a `-b8` report drafts fewer tokens with the same drafter)."""
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for row in summary_rows(run_dir):
        if row["batch"] != 1 or Path(row["report"]).stem.endswith("-fp32") or row["train_minutes"] is None:
            continue
        key = (row["run"], row["dataset"])
        if key not in best or row["block"] > best[key]["block"]:
            best[key] = {name: row[name] for name in ("run", "dataset", "train_minutes", "tau", "tau_teacher_forced",
                                                      "speedup", "steps", "sequences", "block")}
    return sorted(best.values(), key=lambda p: (p["train_minutes"], p["run"], p["dataset"]))


def log_minutes(minutes: list[float]) -> bool:
    """Whether the minutes axis is logarithmic (base 2): when the budgets span a doubling or more. τ grows
    about linearly in the log of training time, so equal gains per doubling then read as a straight line."""
    return bool(minutes) and minutes[0] > 0 and minutes[-1] >= 2 * minutes[0]


def tau_per_doubling(points: list[dict[str, Any]]) -> dict[str, float]:
    """Per dataset with two budgets or more: the least-squares slope of τ against log2(training minutes), i.e.
    the τ each doubling of training time adds, on average over the measured budgets."""
    slopes = {}
    for dataset in sorted({p["dataset"] for p in points}):
        xy = [(math.log2(p["train_minutes"]), p["tau"]) for p in points
              if p["dataset"] == dataset and p["train_minutes"] > 0]
        mean_x = sum(x for x, _ in xy) / max(len(xy), 1)
        spread = sum((x - mean_x) ** 2 for x, _ in xy)
        if len(xy) >= 2 and spread > 0:
            mean_y = sum(y for _, y in xy) / len(xy)
            slopes[dataset] = sum((x - mean_x) * (y - mean_y) for x, y in xy) / spread
    return slopes


def plot_curve(points: list[dict[str, Any]], path: Path) -> Path:
    fig = Figure(figsize=(11, 3.8))
    tau_axis, speed_axis = fig.subplots(1, 2)
    for dataset in sorted({p["dataset"] for p in points}):
        mine = [p for p in points if p["dataset"] == dataset]
        minutes = [p["train_minutes"] for p in mine]
        tau_axis.plot(minutes, [p["tau"] for p in mine], marker="o", label=dataset)
        speeds = [(m, p["speedup"]) for m, p in zip(minutes, mine, strict=True) if p["speedup"] is not None]
        if speeds:
            speed_axis.plot(*zip(*speeds, strict=True), marker="o", label=dataset)
    speed_axis.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    minutes = sorted({p["train_minutes"] for p in points})
    for axis, label in ((tau_axis, "acceptance length τ (batch 1)"), (speed_axis, "decode speedup over the target")):
        if log_minutes(minutes):
            axis.set_xscale("log", base=2)
            axis.set_xticks(minutes, [f"{m:g}" for m in minutes])
            axis.minorticks_off()
        axis.set_xlabel("training minutes")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def table(points: list[dict[str, Any]]) -> str:
    lines = ["| train min | run | dataset | τ | τ̂ teacher-forced | speedup | steps |", "|---|---|---|---|---|---|---|"]
    for p in points:
        speedup = "—" if p["speedup"] is None else f"{p['speedup']:.2f}×"
        teacher = "—" if p["tau_teacher_forced"] is None else f"{p['tau_teacher_forced']:.2f}"
        lines.append(f"| {p['train_minutes']} | {p['run']} | {p['dataset']} | {p['tau']:.2f} | {teacher} | "
                     f"{speedup} | {p['steps'] if p['steps'] is not None else '—'} |")
    return "\n".join(lines) + "\n"


def _foreign_output(run_dir: Path) -> Path | None:
    """An existing curve.json or curve.png that an earlier run of this command did not write, if any."""
    data, figure = run_dir / "curve.json", run_dir / "curve.png"
    if data.exists():
        try:
            points = json.loads(data.read_text())
            ours = isinstance(points, list) and all(isinstance(p, dict) and "train_minutes" in p for p in points)
        except (OSError, ValueError, TypeError):
            ours = False
        return None if ours else data
    return figure if figure.exists() else None


def merged_points(run_dirs: list[Path]) -> list[dict[str, Any]]:
    """The points of several run directories on one curve, each run named after its directory."""
    if len(run_dirs) == 1:
        return curve_points(run_dirs[0])
    points = [{**p, "run": f"{run_dir.name}/{p['run']}"} for run_dir in run_dirs for p in curve_points(run_dir)]
    return sorted(points, key=lambda p: (p["train_minutes"], p["run"], p["dataset"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_train.eval.curve",
                                     description="τ and speedup against training minutes from recipe run "
                                                 "folders' eval reports (writes curve.json and curve.png to the first).")
    parser.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="a recipe's OUT folder")
    run_dirs: list[Path] = parser.parse_args(argv).run_dirs
    args = [str(run_dir) for run_dir in run_dirs]
    missing = [str(run_dir) for run_dir in run_dirs if not run_dir.is_dir()]
    if missing:
        print(f"curve: {', '.join(missing)} is not a folder: give recipe OUT folders", file=sys.stderr)
        return 2
    if len({run_dir.name for run_dir in run_dirs}) < len(run_dirs):
        print("curve: the run directories need different names (a point's run is named dir/run)", file=sys.stderr)
        return 2
    run_dir = run_dirs[0]
    points = merged_points(run_dirs)
    if not points:
        print(f"curve: no batch-1 eval report of a finished training run under {', '.join(args)}; run the train "
              "and eval stages first", file=sys.stderr)
        return 1
    foreign = _foreign_output(run_dir)
    if foreign is not None:
        print(f"curve: {foreign} was not written by this command; move it away, it is not overwritten",
              file=sys.stderr)
        return 1
    (run_dir / "curve.json").write_text(json.dumps(points, indent=2) + "\n")
    plot_curve(points, run_dir / "curve.png")
    print(table(points), end="")
    slopes = tau_per_doubling(points)
    if slopes:
        print("τ per doubling of training minutes (least squares over the budgets): "
              + ", ".join(f"{dataset} {slope:+.2f}" for dataset, slope in slopes.items()))
    print(f"written: {run_dir / 'curve.json'}, {run_dir / 'curve.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
