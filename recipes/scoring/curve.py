"""τ against GPU-minutes of training: what more GPU time buys, from recipe run directories' eval reports.

    python -m recipes.scoring.curve outputs/speedrun     # prints a table, writes curve.json and curve.png
    python -m recipes.scoring.curve runs/a runs/b        # points of several run directories, written to the first
    python -m recipes.scoring.curve runs/a --goal humaneval=4.5   # and where each set's trend reaches its goal

Each training run under `<run>/train/<name>` that has an eval report `<run>/eval/<name>[-b16|-b8].json` at
batch 1 (a `-fp32` check excepted) is one point per dataset: its training minutes (from the last
checkpoint's trainer state) against the report's τ and speedup. Runs trained for different budgets, each
with its own schedule (the speedrun's `curve` stage), make the curve; a run continued with resume is one
point at its total minutes. Runs trained on other machines or days (the same data, another budget) join
the curve from their own directories; with more than one directory a point's run is named `dir/run`.

The x axis is GPU-minutes: training minutes times the processes the run trained on (its trainer state's
`num_processes`), so one-GPU runs sit at their minutes and an 8-GPU run of 3 minutes at 24. The trend, and the
GPU-minutes at which it reaches a goal, are fitted to the runs of the fewest GPUs (the reference curve); a run on
more GPUs is then a point against it: on the curve if its GPUs bought what as many GPU-minutes on one would have,
under it by what the wider batch or the launch costs.
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
            gpus = row.get("gpus") or 1  # runs whose state predates the count trained on one process
            best[key] = {**{name: row[name] for name in ("run", "dataset", "train_minutes", "tau", "tau_ci95",
                                                         "tau_teacher_forced", "speedup", "steps", "sequences",
                                                         "block")},
                         "gpus": gpus, "gpu_minutes": round(row["train_minutes"] * gpus, 1)}
    return sorted(best.values(), key=gpu_minutes_order)


def gpu_minutes_order(point: dict[str, Any]) -> tuple[float, str, str]:
    return point["gpu_minutes"], point["run"], point["dataset"]


def reference(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The points of the runs on the fewest GPUs: the curve the others are judged against."""
    fewest = min((p["gpus"] for p in points), default=1)
    return [p for p in points if p["gpus"] == fewest]


def log_minutes(minutes: list[float]) -> bool:
    """Whether the minutes axis is logarithmic (base 2): when the budgets span a doubling or more. τ grows
    about linearly in the log of training time, so equal gains per doubling then read as a straight line."""
    return bool(minutes) and minutes[0] > 0 and minutes[-1] >= 2 * minutes[0]


def trend(points: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """Per dataset with two budgets or more on the reference curve: the least-squares line τ = intercept + slope ·
    log2(GPU-minutes), as (slope, intercept). The slope is the τ each doubling of training adds on average."""
    lines = {}
    points = reference(points)
    for dataset in sorted({p["dataset"] for p in points}):
        xy = [(math.log2(p["gpu_minutes"]), p["tau"]) for p in points
              if p["dataset"] == dataset and p["gpu_minutes"] > 0]
        mean_x = sum(x for x, _ in xy) / max(len(xy), 1)
        spread = sum((x - mean_x) ** 2 for x, _ in xy)
        if len(xy) >= 2 and spread > 0:
            mean_y = sum(y for _, y in xy) / len(xy)
            slope = sum((x - mean_x) * (y - mean_y) for x, y in xy) / spread
            lines[dataset] = (slope, mean_y - slope * mean_x)
    return lines


def tau_per_doubling(points: list[dict[str, Any]]) -> dict[str, float]:
    """The trend's slope per dataset: the τ each doubling of GPU-minutes adds."""
    return {dataset: slope for dataset, (slope, _) in trend(points).items()}


def minutes_to_goal(points: list[dict[str, Any]], goals: dict[str, float]) -> dict[str, float | None]:
    """Per dataset with a goal: the GPU-minutes at which its trend line reaches the goal τ (None when the trend
    does not rise or the dataset has fewer than two budgets)."""
    lines = trend(points)
    reach: dict[str, float | None] = {}
    for dataset, goal in goals.items():
        slope, intercept = lines.get(dataset, (0.0, 0.0))
        reach[dataset] = 2 ** ((goal - intercept) / slope) if slope > 0 else None
    return reach


def off_the_curve(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each point of a run on more GPUs than the reference, with the τ the reference trend gives at its
    GPU-minutes and the difference: what its GPUs bought against as many GPU-minutes on fewer."""
    lines, fewest = trend(points), min((p["gpus"] for p in points), default=1)
    judged = []
    for p in points:
        if p["gpus"] > fewest and p["dataset"] in lines and p["gpu_minutes"] > 0:
            slope, intercept = lines[p["dataset"]]
            expected = intercept + slope * math.log2(p["gpu_minutes"])
            judged.append({**p, "tau_on_curve": expected, "tau_gap": p["tau"] - expected})
    return judged


MAX_EXTENSION = 8  # the trend is drawn up to this many times the longest budget at most


def plot_curve(points: list[dict[str, Any]], path: Path, goals: dict[str, float] | None = None) -> Path:
    """τ and speedup against GPU-minutes; runs on more GPUs than the reference drawn as squares, labelled with
    their GPUs. With goals, each set's goal τ as a dashed line and the reference trend (the least-squares line
    against log2 GPU-minutes) dotted, extended to where it reaches the goal."""
    goals = goals or {}
    fig = Figure(figsize=(11, 3.8))
    tau_axis, speed_axis = fig.subplots(1, 2)
    minutes = sorted({p["gpu_minutes"] for p in points})
    ticks = list(minutes)
    for dataset in sorted({p["dataset"] for p in points}):
        mine = [p for p in points if p["dataset"] == dataset]
        color = _draw_points(tau_axis, speed_axis, mine, dataset)
        if dataset in goals:
            ticks += _draw_goal(tau_axis, points, dataset, goals[dataset], color, minutes)
    speed_axis.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    axes = ((tau_axis, "acceptance length τ (batch 1)", sorted(set(ticks))),
            (speed_axis, "decode speedup over the target", minutes))
    for axis, label, axis_ticks in axes:
        if log_minutes(minutes):
            axis.set_xscale("log", base=2)
            axis.set_xticks(axis_ticks, [f"{m:g}" for m in axis_ticks])
            axis.minorticks_off()
        axis.set_xlabel("GPU-minutes of training (minutes × GPUs)")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    if goals:
        tau_axis.set_title("dashed: goal; dotted: trend against log2 GPU-minutes", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def _draw_points(tau_axis: Any, speed_axis: Any, mine: list[dict[str, Any]], dataset: str) -> str:
    """One set's reference curve (line and circles, with each point's 95 % interval where its report has one) and
    its runs on more GPUs (squares, labelled); returns the set's colour."""
    ref = reference(mine)
    x = [p["gpu_minutes"] for p in ref]
    (drawn,) = tau_axis.plot(x, [p["tau"] for p in ref], marker="o", label=dataset)
    color = drawn.get_color()
    with_ci = [p for p in mine if p["tau_ci95"]]
    if with_ci:
        tau_axis.errorbar([p["gpu_minutes"] for p in with_ci], [p["tau"] for p in with_ci],
                          yerr=[[p["tau"] - p["tau_ci95"][0] for p in with_ci], [p["tau_ci95"][1] - p["tau"] for p in with_ci]],
                          fmt="none", ecolor=color, capsize=3, alpha=0.6)
    speeds = [(p["gpu_minutes"], p["speedup"]) for p in ref if p["speedup"] is not None]
    if speeds:
        speed_axis.plot(*zip(*speeds, strict=True), marker="o", color=color, label=dataset)
    for p in mine:
        if p in ref:
            continue
        tau_axis.plot([p["gpu_minutes"]], [p["tau"]], marker="s", color=color, linestyle="none")
        tau_axis.annotate(f"{p['gpus']} GPUs", (p["gpu_minutes"], p["tau"]), textcoords="offset points",
                          xytext=(4, 4), fontsize=7, color=color)
        if p["speedup"] is not None:
            speed_axis.plot([p["gpu_minutes"]], [p["speedup"]], marker="s", color=color, linestyle="none")
    return color


def _draw_goal(tau_axis: Any, points: list[dict[str, Any]], dataset: str, goal: float, color: str,
               minutes: list[float]) -> list[float]:
    """The goal's dashed line and the reference trend's dotted one, extended towards the goal (at most
    MAX_EXTENSION times the longest run); the extra tick where the extension ends, if any."""
    tau_axis.axhline(goal, color=color, linewidth=0.8, linestyle="--", alpha=0.7)
    lines = trend(points)
    if dataset not in lines or minutes[0] <= 0:
        return []
    slope, intercept = lines[dataset]
    reach = minutes_to_goal(points, {dataset: goal})[dataset]
    end = min(max(reach or 0.0, minutes[-1]), MAX_EXTENSION * minutes[-1])
    span = [minutes[0], end]
    tau_axis.plot(span, [intercept + slope * math.log2(m) for m in span], color=color, linewidth=0.8, linestyle=":")
    return [round(end)] if end > minutes[-1] else []


def goal_lines(points: list[dict[str, Any]], goals: dict[str, float]) -> list[str]:
    """One line per goal: the first measured budget that reached it (in GPU-minutes, its GPUs named where they
    were more than one), or where the reference trend would."""
    lines = []
    for dataset, minutes in minutes_to_goal(points, goals).items():
        reached = [p for p in points if p["dataset"] == dataset and p["tau"] >= goals[dataset]]
        if reached:
            first = min(reached, key=gpu_minutes_order)
            on = f", on {first['gpus']} GPUs" if first["gpus"] > 1 else ""
            lines.append(f"{dataset}: τ {goals[dataset]:.2f} reached at {first['gpu_minutes']:g} GPU-minutes "
                         f"(measured{on})")
        elif minutes is None:
            lines.append(f"{dataset}: τ {goals[dataset]:.2f} not reached, and no rising trend over two budgets or more")
        else:
            lines.append(f"{dataset}: τ {goals[dataset]:.2f} at about {minutes:.0f} GPU-minutes if τ keeps "
                         "rising as it has")
    return lines


def gap_lines(points: list[dict[str, Any]]) -> list[str]:
    """One line per point of a run on more GPUs: its τ against the reference trend's at its GPU-minutes."""
    return [f"{p['run']} ({p['gpus']} GPUs, {p['gpu_minutes']:g} GPU-minutes), {p['dataset']}: τ {p['tau']:.2f} "
            f"against {p['tau_on_curve']:.2f} on the curve ({p['tau_gap']:+.2f})" for p in off_the_curve(points)]


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
    lines = ["| GPU-min | GPUs | train min | run | dataset | τ | τ̂ teacher-forced | speedup | steps |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        speedup = "—" if p["speedup"] is None else f"{p['speedup']:.2f}×"
        teacher = "—" if p["tau_teacher_forced"] is None else f"{p['tau_teacher_forced']:.2f}"
        lines.append(f"| {p['gpu_minutes']:g} | {p['gpus']} | {p['train_minutes']} | {p['run']} | {p['dataset']} | "
                     f"{p['tau']:.2f} | {teacher} | "
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
    return sorted(points, key=gpu_minutes_order)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.scoring.curve",
                                     description="τ and speedup against GPU-minutes of training from recipe run "
                                                 "folders' eval reports (writes curve.json and curve.png to the first).")
    parser.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="a recipe's OUT folder")
    parser.add_argument("--goal", type=parse_goal, action="append", default=[], metavar="DATASET=TAU",
                        help="a τ goal of one eval set (repeatable), e.g. humaneval=4.5: drawn with the set's trend, "
                             "and the GPU-minutes at which the trend reaches it are printed")
    parsed = parser.parse_args(argv)
    run_dirs: list[Path] = parsed.run_dirs
    refused = _refusal(run_dirs)
    if refused is not None:
        code, message = refused
        print(f"curve: {message}", file=sys.stderr)
        return code
    run_dir, points, goals = run_dirs[0], merged_points(run_dirs), dict(parsed.goal)
    (run_dir / "curve.json").write_text(json.dumps(points, indent=2) + "\n")
    plot_curve(points, run_dir / "curve.png", goals)
    print(table(points), end="")
    slopes = tau_per_doubling(points)
    if slopes:
        print("τ per doubling of GPU-minutes (least squares over the reference runs' budgets): "
              + ", ".join(f"{dataset} {slope:+.2f}" for dataset, slope in slopes.items()))
    for line in gap_lines(points):
        print(line)
    unknown = sorted(set(goals) - {p["dataset"] for p in points})
    if unknown:
        print(f"curve: no points of {', '.join(unknown)} (sets evaluated: "
              f"{', '.join(sorted({p['dataset'] for p in points}))}); its goal is left out", file=sys.stderr)
    for line in goal_lines(points, {k: v for k, v in goals.items() if k not in unknown}):
        print(line)
    print(f"written: {run_dir / 'curve.json'}, {run_dir / 'curve.png'}")
    return 0


def _refusal(run_dirs: list[Path]) -> tuple[int, str] | None:
    """(exit code, one line) for folders that cannot make a curve, or None."""
    missing = [str(run_dir) for run_dir in run_dirs if not run_dir.is_dir()]
    if missing:
        return 2, f"{', '.join(missing)} is not a folder: give recipe OUT folders"
    if len({run_dir.name for run_dir in run_dirs}) < len(run_dirs):
        return 2, "the run directories need different names (a point's run is named dir/run)"
    if not merged_points(run_dirs):
        return 1, (f"no batch-1 eval report of a finished training run under {', '.join(map(str, run_dirs))}; run "
                   "the train and eval stages first")
    foreign = _foreign_output(run_dirs[0])
    if foreign is not None:
        return 1, f"{foreign} was not written by this command; move it away, it is not overwritten"
    return None


if __name__ == "__main__":
    sys.exit(main())
