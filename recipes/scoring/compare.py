"""Training runs side by side: each run's last validation, overall and per data source, with its steps and
minutes.

    python -m recipes.scoring.compare outputs/speedrun/train/ablation-*     # prints a Markdown table
    python -m recipes.scoring.compare RUN... --plot ablations.png   # + loss and τ̂ against minutes
    python -m recipes.scoring.compare RUN... --evals outputs/speedrun/eval   # + decoded τ per eval set
    python -m recipes.scoring.compare RUN... --evals DIR --temperature 1    # the decoded τ at temperature 1

An ablation at equal GPU-minutes is a few runs on the same prepared data (so the same validation split), one
setting changed in each, each with the same wall-time budget; this table judges them by held-out τ̂ before
any decoding eval (the speedrun's `ablate` stage prints it). τ̂ per source shows which kind of data a change
helps: a mix's easy sources can hide a loss on the chat or code a user serves. With ``--evals DIR``, each run's
eval report ``DIR/<run>-b16.json`` (`dflash-train eval --out`) adds the decoded τ of every set it measured:
held-out τ̂ is teacher-forced on the training mix; decoded τ is what a user gets on the eval prompts. Reports
that list each request's τ add, for every run but the baseline (`--base`, default the run named `*base`),
Δτ against the baseline on the same requests with its 95 % bootstrap interval (`*`: the interval excludes 0).
Decoded τ is the reports' own, the lowest temperature of a sweep (`dflash-train eval --temperature 0,0.7,1`);
``--temperature T`` takes each report's results at T from its `temperature_sweep` instead (a report of one
temperature only at its own), and refuses in one line reports that lack T.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

# A bare Figure, not pyplot: no backend to choose and no global figure state.
from matplotlib.figure import Figure

from dflash_train.eval.uncertainty import format_difference, paired_difference
from dflash_train.training.tracking import read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"  # an earlier plot may be replaced; any other file is the user's


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


def report_temperatures(report: dict[str, Any]) -> list[float]:
    """The temperatures a report decoded at: its sweep's, or its own one (0 where it names none)."""
    sweep = report.get("temperature_sweep")
    if sweep:
        return [float(t) for t in sweep["temperatures"]]
    return [float((report.get("settings") or {}).get("temperature", 0.0))]


def read_report(path: Path) -> dict[str, Any] | None:
    """An eval report, or None when it is missing or not one (its run then shows no decoded τ)."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def results_at(report: dict[str, Any], temperature: float | None) -> dict[str, Any] | None:
    """The report's results per eval set at `temperature` (None: its own, the lowest of a sweep); None when it
    did not decode at that temperature."""
    if temperature is None:
        return report.get("datasets", {})
    sweep = report.get("temperature_sweep")
    runs = sweep["runs"] if sweep else [{"temperature": report_temperatures(report)[0],
                                         "datasets": report.get("datasets", {})}]
    return next((run["datasets"] for run in runs if math.isclose(run["temperature"], temperature, abs_tol=1e-9)),
                None)


def decoded_tau(report: Path, temperature: float | None = None) -> dict[str, float]:
    """Eval set -> decoded τ (acceptance length) from an eval report at `temperature` (None: the report's own);
    empty when there is none or it is not one."""
    try:
        datasets = results_at(read_report(report) or {}, temperature) or {}
        return {name: float(values["acceptance_length"]) for name, values in datasets.items()
                if values.get("acceptance_length") is not None}
    except (ValueError, AttributeError, KeyError, TypeError):
        return {}


def per_request_tau(report: Path, temperature: float | None = None) -> dict[str, dict[tuple[int, int], float]]:
    """Eval set -> {(conversation, turn): that request's τ} from a report that lists them; empty otherwise."""
    try:
        datasets = results_at(read_report(report) or {}, temperature) or {}
        return {name: {(int(c), int(t)): float(tau) for c, t, tau in values.get("acceptance_length_per_request") or []
                       if tau is not None} for name, values in datasets.items()}
    except (ValueError, AttributeError, KeyError, TypeError):
        return {}


def lacking_temperature(evals: Path, runs: list[str], temperature: float) -> str | None:
    """A one-line refusal naming the runs whose report exists but did not decode at `temperature`, or None."""
    lacking = {}
    for run in runs:
        report = read_report(evals / f"{run}-b16.json")
        if report is not None and "datasets" in report and results_at(report, temperature) is None:
            lacking[run] = report_temperatures(report)
    if not lacking:
        return None
    held = "; ".join(f"{run} at {', '.join(f'{t:g}' for t in temps)}" for run, temps in lacking.items())
    return (f"compare: no eval at temperature {temperature:g} in the reports of {held}: evaluate them with "
            f"--temperature listing {temperature:g}, or give --temperature one they have")


def add_paired_differences(rows: list[dict[str, Any]], evals: Path, base: str | None,
                           temperature: float | None = None) -> None:
    """Each row but the baseline gets `paired`: eval set -> Δτ against the baseline on their shared requests
    (at `temperature`, as `decoded_tau`)."""
    names = [row["run"] for row in rows]
    base = base or next((name for name in names if name.endswith("base")), names[0])
    if base not in names:
        return
    baseline = per_request_tau(evals / f"{base}-b16.json", temperature)
    for row in rows:
        if row["run"] != base:
            requests = per_request_tau(evals / f"{row['run']}-b16.json", temperature)
            row["paired"] = {name: paired_difference(requests.get(name, {}), baseline.get(name, {}))
                             for name in row.get("decoded", {})}


def markdown(rows: list[dict[str, Any]], temperature: float | None = None) -> str:
    """The table; with `temperature`, its decoded-τ columns name it (`τ mt-bench T=1`)."""
    at = "" if temperature is None else f" T={temperature:g}"
    sources = sorted({name for row in rows for name in row["by_source"]})
    eval_sets = sorted({name for row in rows for name in row.get("decoded", {})})
    paired_sets = sorted({name for row in rows for name, d in row.get("paired", {}).items() if d is not None})
    header = ["run", "step", "train min", "val loss", "val τ̂", *(f"τ̂ {name}" for name in sources),
              *(f"τ {name}{at}" for name in eval_sets), *(f"Δτ {name}{at} (95% CI)" for name in paired_sets)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        per_source = [f"{row['by_source'][name]:.2f}" if name in row["by_source"] else "—" for name in sources]
        decoded = row.get("decoded", {})
        per_set = [f"{decoded[name]:.2f}" if name in decoded else "—" for name in eval_sets]
        paired = [format_difference(row.get("paired", {}).get(name)) for name in paired_sets]
        minutes = "—" if row["train_minutes"] is None else str(row["train_minutes"])
        lines.append("| " + " | ".join([row["run"], str(row["step"]), minutes, f"{row['loss']:.3f}",
                                        f"{row['tau_hat']:.2f}", *per_source, *per_set, *paired]) + " |")
    return "\n".join(lines) + "\n"


def minutes_per_step(run_dir: Path) -> float | None:
    """The run's median logged step time in minutes: the compiling first steps would otherwise shift a run's
    whole curve right."""
    train = read_metrics(run_dir / "metrics.jsonl").get("train", [])
    timed = [r["step_seconds"] for r in train if "step_seconds" in r]
    return statistics.median(timed) / 60 if timed else None


def loss_curve(run_dir: Path, window: int = 5) -> tuple[list[float], list[float]]:
    """(minutes, training loss) of a run, the loss averaged over `window` logged steps; minutes are steps
    times the run's median step time."""
    train = read_metrics(run_dir / "metrics.jsonl").get("train", [])
    per_step = minutes_per_step(run_dir)
    if per_step is None:
        return [], []
    losses = [r["loss"] for r in train]
    smoothed = [statistics.fmean(losses[max(0, i - window + 1): i + 1]) for i in range(len(losses))]
    return [r["step"] * per_step for r in train], smoothed


def tau_hat_curve(run_dir: Path) -> tuple[list[float], list[float]]:
    """(minutes, held-out τ̂) at each validation of a run, minutes as in `loss_curve`."""
    validation = read_metrics(run_dir / "metrics.jsonl").get("validation", [])
    per_step = minutes_per_step(run_dir)
    if per_step is None:
        return [], []
    return [r["step"] * per_step for r in validation], [r["expected_acceptance_length"] for r in validation]


def plot(rows: list[dict[str, Any]], run_dirs: dict[str, Path], out: Path) -> Path:
    """Training loss and held-out τ̂ against minutes for every run (a time-fitted schedule decays at its own
    end, so a point inside a longer run is not what a run of that length would reach)."""
    fig = Figure(figsize=(12, 4.5))
    curves, taus = fig.subplots(1, 2)
    for row in rows:
        minutes, losses = loss_curve(run_dirs[row["run"]])
        curves.plot(minutes, losses, label=f"{row['run']} (val loss {row['loss']:.2f})")
        minutes, tau_hats = tau_hat_curve(run_dirs[row["run"]])
        taus.plot(minutes, tau_hats, marker="o", markersize=3, label=f"{row['run']} ({row['tau_hat']:.2f})")
    curves.set(title="training loss", xlabel="minutes of training (steps × median step time)", ylabel="loss",
               yscale="log")
    taus.set(title="held-out τ̂ (teacher-forced)", xlabel="minutes of training (steps × median step time)",
             ylabel="τ̂")
    for axes in (curves, taus):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Training runs side by side: last validation, overall and per "
                                                 "data source (a Markdown table)")
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--plot", type=Path, default=None, help="also draw training loss and held-out τ̂ against minutes here")
    parser.add_argument("--evals", type=Path, default=None, metavar="DIR",
                        help="eval reports DIR/<run>-b16.json: adds each run's decoded τ per eval set")
    parser.add_argument("--base", default=None, metavar="RUN",
                        help="with --evals: the run the others' Δτ is paired against (default: the run named *base)")
    parser.add_argument("--temperature", type=float, default=None, metavar="T",
                        help="with --evals: the decoded τ and Δτ at temperature T, from each report's temperature "
                             "sweep (default: the reports' own figures, a sweep's lowest temperature)")
    args = parser.parse_args(argv)
    if args.temperature is not None and (args.evals is None or not 0 <= args.temperature < math.inf):
        print("compare: --temperature takes a temperature >= 0 and reads the reports of --evals DIR; give both",
              file=sys.stderr)
        return 2
    found = {run: run_row(run) for run in args.runs}
    rows = [row for row in found.values() if row is not None]
    if args.evals is not None:
        refusal = None if args.temperature is None else lacking_temperature(
            args.evals, [row["run"] for row in rows], args.temperature)
        if refusal:
            print(refusal, file=sys.stderr)
            return 2
        for row in rows:
            row["decoded"] = decoded_tau(args.evals / f"{row['run']}-b16.json", args.temperature)
        if args.base is not None and args.base not in {row["run"] for row in rows}:
            print(f"compare: --base {args.base} is not one of the runs with a validation; give one of "
                  f"{', '.join(row['run'] for row in rows) or 'them'}", file=sys.stderr)
            return 2
        if rows:
            add_paired_differences(rows, args.evals, args.base, args.temperature)
    if not rows:
        print(f"compare: none of {len(args.runs)} run folders has a validation in its metrics.jsonl; train them "
              "with training.eval_every below their length", file=sys.stderr)
        return 1
    if args.plot and args.plot.exists() and args.plot.read_bytes()[:8] != PNG_MAGIC:
        print(f"compare: {args.plot} exists and is not a plot; give --plot a new .png path", file=sys.stderr)
        return 1
    print(markdown(rows, args.temperature), end="")
    if args.plot:
        print(f"plot -> {plot(rows, {run.name: run for run in found}, args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
