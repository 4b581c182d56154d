"""τ against training minutes: what more GPU time buys, from a recipe run directory's eval reports.

    python -m recipes.scoring.curve outputs/speedrun     # prints a table, writes curve.json and curve.png
    python -m recipes.scoring.curve runs/a runs/b        # points of several run directories, written to the first
    python -m recipes.scoring.curve runs/a --goal humaneval=4.5   # and where each set's trend reaches its goal

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

from recipes.scoring.summary import summary_rows


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
            best[key] = {name: row[name] for name in ("run", "dataset", "train_minutes", "tau", "tau_ci95",
                                                      "tau_teacher_forced", "speedup", "steps", "sequences", "block")}
    return sorted(best.values(), key=lambda p: (p["train_minutes"], p["run"], p["dataset"]))


def log_minutes(minutes: list[float]) -> bool:
    """Whether the minutes axis is logarithmic (base 2): when the budgets span a doubling or more. τ grows
    about linearly in the log of training time, so equal gains per doubling then read as a straight line."""
    return bool(minutes) and minutes[0] > 0 and minutes[-1] >= 2 * minutes[0]


def trend(points: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """Per dataset with two budgets or more: the least-squares line τ = intercept + slope · log2(training
    minutes), as (slope, intercept). The slope is the τ each doubling of training time adds on average."""
    lines = {}
    for dataset in sorted({p["dataset"] for p in points}):
        xy = [(math.log2(p["train_minutes"]), p["tau"]) for p in points
              if p["dataset"] == dataset and p["train_minutes"] > 0]
        mean_x = sum(x for x, _ in xy) / max(len(xy), 1)
        spread = sum((x - mean_x) ** 2 for x, _ in xy)
        if len(xy) >= 2 and spread > 0:
            mean_y = sum(y for _, y in xy) / len(xy)
            slope = sum((x - mean_x) * (y - mean_y) for x, y in xy) / spread
            lines[dataset] = (slope, mean_y - slope * mean_x)
    return lines


def tau_per_doubling(points: list[dict[str, Any]]) -> dict[str, float]:
    """The trend's slope per dataset: the τ each doubling of training minutes adds."""
    return {dataset: slope for dataset, (slope, _) in trend(points).items()}


def minutes_to_goal(points: list[dict[str, Any]], goals: dict[str, float]) -> dict[str, float | None]:
    """Per dataset with a goal: the training minutes at which its trend line reaches the goal τ (None when the
    trend does not rise or the dataset has fewer than two budgets)."""
    lines = trend(points)
    reach: dict[str, float | None] = {}
    for dataset, goal in goals.items():
        slope, intercept = lines.get(dataset, (0.0, 0.0))
        reach[dataset] = 2 ** ((goal - intercept) / slope) if slope > 0 else None
    return reach


MAX_EXTENSION = 8  # the trend is drawn up to this many times the longest budget at most


def plot_curve(points: list[dict[str, Any]], path: Path, goals: dict[str, float] | None = None) -> Path:
    """τ and speedup against minutes; with goals, each set's goal τ as a dashed line and its trend (the
    least-squares line against log2 minutes) dotted, extended to where it reaches the goal."""
    goals = goals or {}
    fig = Figure(figsize=(11, 3.8))
    tau_axis, speed_axis = fig.subplots(1, 2)
    minutes = sorted({p["train_minutes"] for p in points})
    lines, reach = trend(points), minutes_to_goal(points, goals)
    ticks = list(minutes)
    for dataset in sorted({p["dataset"] for p in points}):
        mine = [p for p in points if p["dataset"] == dataset]
        mine_minutes = [p["train_minutes"] for p in mine]
        (drawn,) = tau_axis.plot(mine_minutes, [p["tau"] for p in mine], marker="o", label=dataset)
        intervals = [(m, p["tau"], p["tau_ci95"]) for m, p in zip(mine_minutes, mine, strict=True) if p["tau_ci95"]]
        if intervals:  # each point's 95 % interval over its requests (reports that have one)
            m, tau, ci = zip(*intervals, strict=True)
            below, above = [t - c[0] for t, c in zip(tau, ci, strict=True)], [c[1] - t for t, c in zip(tau, ci, strict=True)]
            tau_axis.errorbar(m, tau, yerr=[below, above], fmt="none", ecolor=drawn.get_color(), capsize=3, alpha=0.6)
        speeds = [(m, p["speedup"]) for m, p in zip(mine_minutes, mine, strict=True) if p["speedup"] is not None]
        if speeds:
            speed_axis.plot(*zip(*speeds, strict=True), marker="o", label=dataset)
        if dataset in goals:
            tau_axis.axhline(goals[dataset], color=drawn.get_color(), linewidth=0.8, linestyle="--", alpha=0.7)
            if dataset in lines and minutes[0] > 0:
                slope, intercept = lines[dataset]
                end = min(max(reach[dataset] or 0.0, minutes[-1]), MAX_EXTENSION * minutes[-1])
                span = [minutes[0], end]
                tau_axis.plot(span, [intercept + slope * math.log2(m) for m in span], color=drawn.get_color(),
                              linewidth=0.8, linestyle=":")
                if end > minutes[-1]:
                    ticks.append(round(end))
    speed_axis.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    axes = ((tau_axis, "acceptance length τ (batch 1)", sorted(set(ticks))),
            (speed_axis, "decode speedup over the target", minutes))
    for axis, label, axis_ticks in axes:
        if log_minutes(minutes):
            axis.set_xscale("log", base=2)
            axis.set_xticks(axis_ticks, [f"{m:g}" for m in axis_ticks])
            axis.minorticks_off()
        axis.set_xlabel("training minutes")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    if goals:
        tau_axis.set_title("dashed: goal; dotted: trend against log2 minutes", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def goal_lines(points: list[dict[str, Any]], goals: dict[str, float]) -> list[str]:
    """One line per goal: the first measured budget that reached it, or where the trend would."""
    lines = []
    for dataset, minutes in minutes_to_goal(points, goals).items():
        reached = [p["train_minutes"] for p in points if p["dataset"] == dataset and p["tau"] >= goals[dataset]]
        if reached:
            lines.append(f"{dataset}: τ {goals[dataset]:.2f} reached at {min(reached):g} training minutes (measured)")
        elif minutes is None:
            lines.append(f"{dataset}: τ {goals[dataset]:.2f} not reached, and no rising trend over two budgets or more")
        else:
            lines.append(f"{dataset}: τ {goals[dataset]:.2f} at about {minutes:.0f} training minutes if τ keeps "
                         "rising as it has")
    return lines


def parse_goal(text: str) -> tuple[str, float]:
    """`DATASET=TAU`, e.g. `humaneval=4.5`."""
    dataset, sep, value = text.partition("=")
    try:
        tau = float(value)
    except ValueError:
        tau = float("nan")
    if not sep or not dataset or not tau > 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not DATASET=TAU with TAU > 1, e.g. humaneval=4.5")
    return dataset, tau


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
    parser = argparse.ArgumentParser(prog="python -m recipes.scoring.curve",
                                     description="τ and speedup against training minutes from recipe run "
                                                 "folders' eval reports (writes curve.json and curve.png to the first).")
    parser.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="a recipe's OUT folder")
    parser.add_argument("--goal", type=parse_goal, action="append", default=[], metavar="DATASET=TAU",
                        help="a τ goal of one eval set (repeatable), e.g. humaneval=4.5: drawn with the set's trend, "
                             "and the minutes at which the trend reaches it are printed")
    parsed = parser.parse_args(argv)
    run_dirs: list[Path] = parsed.run_dirs
    goals = dict(parsed.goal)
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
    plot_curve(points, run_dir / "curve.png", goals)
    print(table(points), end="")
    slopes = tau_per_doubling(points)
    if slopes:
        print("τ per doubling of training minutes (least squares over the budgets): "
              + ", ".join(f"{dataset} {slope:+.2f}" for dataset, slope in slopes.items()))
    unknown = sorted(set(goals) - {p["dataset"] for p in points})
    if unknown:
        print(f"curve: no points of {', '.join(unknown)} (sets evaluated: "
              f"{', '.join(sorted({p['dataset'] for p in points}))}); its goal is left out", file=sys.stderr)
    for line in goal_lines(points, {k: v for k, v in goals.items() if k not in unknown}):
        print(line)
    print(f"written: {run_dir / 'curve.json'}, {run_dir / 'curve.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
