"""One table for a recipe run directory: each eval report with the training run behind it.

    python -m recipes.scoring.summary outputs/smollm2-h200     # prints Markdown, writes summary.json/.md

Reads `<run>/eval/*.json` (reports of `dflash-train eval`) and `<run>/train/<name>/checkpoints/*/
trainer_state.json`; a report named `<name>-b8` belongs to the training run `<name>`. A regeneration's
`regen_stats.json` (`<run>/regen`, `-chat`, `-sampled`) adds a "regeneration:" line and `summary_regeneration.json`
(summary.json stays a list of eval rows, as its readers expect); the prepared chats (`<run>/prepared/dflash_data.json`)
a "data:" line (chats kept: the distinct conversations training saw, and why the others were dropped); each
training run a "training:" line (steps, median step, the cold first step). A report of a temperature sweep
(`dflash-train eval --temperature 0,0.7,1`) adds a column per temperature above 0: τ there and its share of
the greedy τ; the τ column is the sweep's lowest temperature, as the report's own figures are. `--goal
KEY=VALUE` checks the run against its goals (goals.py): a "goals:" line and `summary_goals.json`, and with a
sweep a separate "sampling goals:" line and `summary_sampling_goals.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dflash_train.eval.console import lossless_mark
from dflash_train.eval.uncertainty import format_interval
from dflash_train.training.flops import peak_bf16_rate
from recipes.scoring.goals import (
    check_goals,
    check_sampling_goals,
    goals_line,
    logged_train_steps,
    median,
    parse_goals,
    write_goals,
)

SUFFIXES = ("-b16", "-b8", "-fp32")  # report names: <training run>[-b8|-b16|-fp32]
REGEN_DIRS = ("regen", "regen-chat", "regen-sampled")  # the speedrun's regeneration folders
COLUMNS = ("run", "block", "batch", "dtype", "dataset", "requests", "τ", "τ 95% CI", "τ̂ teacher-forced", "lossless", "speedup",
           "cycle in steps", "steps", "sequences", "train min")


def training_state(train_dir: Path) -> dict[str, Any]:
    states = sorted(train_dir.glob("checkpoints/step-*/trainer_state.json"))
    return json.loads(states[-1].read_text()) if states else {}


def summary_rows(run_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for report_path in sorted((run_dir / "eval").glob("*.json")):
        report = json.loads(report_path.read_text())
        if "datasets" not in report:
            continue
        name = next((report_path.stem.removesuffix(x) for x in SUFFIXES if report_path.stem.endswith(x)),
                    report_path.stem)
        state = training_state(run_dir / "train" / name)
        for dataset, result in report["datasets"].items():
            rows.append({
                "run": name, "block": report["settings"]["block_size"],
                "batch": report["settings"].get("batch_size", 1), "dtype": report["settings"].get("dtype", "—"),
                "dataset": dataset,
                "requests": result["requests"], "tau": result["acceptance_length"],
                "tau_ci95": result.get("acceptance_length_ci95"),
                "tau_teacher_forced": result.get("teacher_forced_acceptance_length"), "lossless": lossless_mark(result),
                "speedup": result.get("speedup"), "cycle_in_steps": cycle_in_steps(result), "steps": state.get("step"),
                "sequences": state.get("sequences_seen"), "train_minutes": _minutes(state.get("train_seconds")),
                "gpus": state.get("num_processes"),
                "histogram": result.get("histogram"), "report": str(report_path),
                "tau_by_turn": result.get("acceptance_length_by_turn"),
                "tau_by_category": result.get("acceptance_length_by_category"),
                "temperature_sweep": temperature_sweep(report, dataset),
            })
    return rows


def temperature_sweep(report: dict[str, Any], dataset: str) -> list[dict[str, Any]] | None:
    """One set's τ, its interval, the speedup and τ's share of the greedy τ at each temperature of the report's
    sweep, lowest first; None for a report of one temperature."""
    sweep = report.get("temperature_sweep")
    if not sweep or dataset not in sweep.get("summary", {}):
        return None
    figures, temperatures = sweep["summary"][dataset], sweep["temperatures"]
    fractions = figures.get("fraction_of_greedy") or [None] * len(temperatures)  # null without 0 in the sweep
    return [{"temperature": t, "tau": tau, "tau_ci95": ci, "speedup": speedup, "fraction_of_greedy": fraction}
            for t, tau, ci, speedup, fraction in zip(temperatures, figures["acceptance_length"],
                                                     figures["acceptance_length_ci95"], figures["speedup"],
                                                     fractions, strict=True)]


def swept_temperatures(rows: list[dict[str, Any]]) -> list[float]:
    """The temperatures above 0 of every row's sweep, each once, in increasing order: one column each."""
    return sorted({p["temperature"] for r in rows for p in r.get("temperature_sweep") or [] if p["temperature"] > 0})


def tau_at(row: dict[str, Any], temperature: float) -> str:
    """`3.48 (86%)`: the row's τ at `temperature` and its share of the greedy τ; `—` where not measured."""
    point = next((p for p in row.get("temperature_sweep") or [] if p["temperature"] == temperature), None)
    if point is None or point["tau"] is None:
        return "—"
    share = point["fraction_of_greedy"]
    return f"{point['tau']:.2f}" + ("" if share is None else f" ({share:.0%})")


def cycle_in_steps(result: dict[str, Any]) -> float | None:
    """A draft-and-verify cycle's time in target steps: decoding seconds per cycle over the target alone's
    seconds per token (speedup = tokens per cycle / this). None where the report has no timings."""
    keys = ("decode_seconds_with_draft", "cycles", "decode_seconds_target_only", "new_tokens_target_only")
    if not all(result.get(key) for key in keys):
        return None
    cycle = result["decode_seconds_with_draft"] / result["cycles"]
    return cycle / (result["decode_seconds_target_only"] / result["new_tokens_target_only"])


def _minutes(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds / 60, 1)


def regeneration_figures(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Per regeneration folder with a stats file: answers and answer tokens over every shard, and the rates
    of the run that wrote the file last (a resumed run's rates count its own shards only)."""
    figures = {}
    for name in REGEN_DIRS:
        path = run_dir / name / "regen_stats.json"
        if not path.is_file():
            continue
        stats = json.loads(path.read_text())
        figures[name] = {
            "answers": stats["all_shards"]["rows"], "answer_tokens": stats["all_shards"]["answer_tokens"],
            "units": stats["all_shards"]["units"], "num_units": stats["num_units"],
            "tokens_per_second_decoding": stats["answer_tokens_per_second_decoding"],
            "tokens_per_second_overall": stats["answer_tokens_per_second_overall"],
        }
    return figures


def regeneration_line(name: str, f: dict[str, Any]) -> str:
    return (f"regeneration: {name}: {f['answers']:,} answers, {f['answer_tokens']:,} answer tokens "
            f"({f['units']} of {f['num_units']} units), {f['tokens_per_second_decoding']:,.0f} tokens/s while "
            f"decoding, {f['tokens_per_second_overall']:,.0f} overall")


def report_regeneration(run_dir: Path) -> None:
    regeneration = regeneration_figures(run_dir)
    for name, figures in regeneration.items():
        print(regeneration_line(name, figures))
    if regeneration:
        (run_dir / "summary_regeneration.json").write_text(json.dumps(regeneration, indent=2) + "\n")


def data_line(run_dir: Path) -> str | None:
    """The prepared chats of `<run>/prepared`: kept (one per distinct conversation: prepare drops repeats),
    their tokens, and each reason a row was dropped; None without a prepared dataset."""
    path = run_dir / "prepared" / "dflash_data.json"
    if not path.is_file():
        return None
    counts = json.loads(path.read_text())["counts"]
    dropped = ", ".join(f"{reason} {n:,}" for reason, n in sorted(counts.get("dropped", {}).items()))
    return (f"data: {counts['kept']:,} chats kept of {counts['read']:,} answers, {counts['tokens']:,} tokens "
            f"({counts['supervised tokens']:,} supervised); dropped: {dropped or 'none'}")


def training_figures(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Per training run under `<run>/train`: steps, minutes, the median logged step and the cold first step
    (compilation included; runs older than this field have none)."""
    figures = {}
    for train_dir in sorted(p for p in (run_dir / "train").glob("*") if p.is_dir()):
        state = training_state(train_dir)
        if not state:
            continue
        train = logged_train_steps(train_dir)
        # the first logged step is the cold start (compilation): the run's MFU is that of the steps after it
        mfu = [r["mfu"] for r in train[1:] if "mfu" in r]
        step_mfu = [r["step_mfu"] for r in train[1:] if "step_mfu" in r]  # the target's pass counted too
        graphs = [r.get("step_graphs") for r in train]
        figures[train_dir.name] = {
            # the drafter's step from CUDA graphs: the shapes captured by the last logged step, and whether the
            # graphs were turned off during the run (logged at first, not at the end)
            "step_graphs": graphs[-1] if graphs else None,
            "step_graphs_off": bool(graphs) and graphs[-1] is None and any(g is not None for g in graphs),
            "steps": state.get("step"), "train_minutes": _minutes(state.get("train_seconds")),
            "median_step_seconds": median([r["step_seconds"] for r in train if "step_seconds" in r]),
            "first_step_seconds": state.get("first_step_seconds"),
            "median_mfu": median(mfu), "median_step_mfu": median(step_mfu), "device": state.get("device"),
            "peak_tflops": _peak_tflops(train, state.get("num_processes") or 1),
        }
    return figures


def _peak_tflops(train: list[dict[str, Any]], devices: int) -> float | None:
    """The peak rate one device's MFU was divided by, in TFLOP/s: what a step's FLOPs over its seconds over its
    MFU gives, so it is the run's own (an override of the day included), not today's table."""
    for record in reversed(train):
        if record.get("mfu") and record.get("flops") and record.get("step_seconds"):
            return record["flops"] / record["step_seconds"] / record["mfu"] / devices / 1e12
    return None


def _peak_words(f: dict[str, Any]) -> str:
    """"; of 790 TFLOP/s a device (measured)": MFU figures of two devices compare only with their peaks beside them
    (this project's H200 figure is a measured rate, most others the data sheet's)."""
    if f.get("peak_tflops") is None:
        return ""
    rate = peak_bf16_rate(f.get("device") or "")
    known = rate is not None and abs(rate.flops / 1e12 - f["peak_tflops"]) < 0.5
    return f"; of {f['peak_tflops']:.0f} TFLOP/s a device" + (f" ({rate.source})" if known else "")


def training_line(name: str, f: dict[str, Any]) -> str:
    def seconds(value: float | None) -> str:
        return "—" if value is None else f"{value:.3g} s"

    peak = _peak_words(f)
    mfu = "" if f.get("median_mfu") is None else f", MFU {100 * f['median_mfu']:.1f} % (median{peak})"
    if f.get("median_step_mfu") is not None and f.get("median_mfu") is not None:
        mfu = (f", MFU {100 * f['median_mfu']:.1f} % the drafter's, {100 * f['median_step_mfu']:.1f} % with the "
               f"target's pass (medians{peak})")
    device = "" if f.get("device") is None else f" on {f['device']}"
    graphs = ""
    if f.get("step_graphs") is not None:
        graphs = f", the drafter's step from CUDA graphs ({f['step_graphs']} shapes)"
    elif f.get("step_graphs_off"):
        graphs = ", the drafter's CUDA graphs turned off during the run (its log says why)"
    return (f"training: {name}: {f['steps']:,} steps in {f['train_minutes']} min{device}, median step "
            f"{seconds(f['median_step_seconds'])}{mfu}{graphs}, first step {seconds(f['first_step_seconds'])} "
            "(compilation included)")


def markdown(rows: list[dict[str, Any]]) -> str:
    def cell(value: Any, spec: str = "") -> str:
        return "—" if value is None else format(value, spec)

    temperatures = swept_temperatures(rows)  # none without a sweep: the table as it always was
    at = COLUMNS.index("τ 95% CI") + 1
    columns = [*COLUMNS[:at], *(f"τ T={t:g} (of greedy)" for t in temperatures), *COLUMNS[at:]]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["run"], str(r["block"]), str(r["batch"]), r["dtype"], r["dataset"], str(r["requests"]),
            cell(r["tau"], ".2f"), format_interval(r.get("tau_ci95")), *(tau_at(r, t) for t in temperatures),
            cell(r["tau_teacher_forced"], ".2f"),
            r["lossless"], cell(r["speedup"], ".2f") + ("×" if r["speedup"] else ""), cell(r["cycle_in_steps"], ".2f"),
            cell(r["steps"]), cell(r["sequences"]), cell(r["train_minutes"]),
        ]) + " |")
    return "\n".join(lines) + "\n"


def breakdown_lines(rows: list[dict[str, Any]]) -> list[str]:
    """τ by turn (multi-turn sets) and by category (sets whose rows name one), a line per eval row."""
    lines = []
    for r in rows:
        parts = []
        if r.get("tau_by_turn") and len(r["tau_by_turn"]) > 1:
            parts.append("by turn " + " / ".join("—" if t is None else f"{t:.2f}" for t in r["tau_by_turn"]))
        if r.get("tau_by_category"):
            parts.append("by category " + ", ".join(
                f"{name} {'—' if t is None else f'{t:.2f}'}" for name, t in r["tau_by_category"].items()))
        if parts:
            lines.append(f"τ of {r['run']} ({r['dtype']}, batch {r['batch']}) on {r['dataset']}: " + "; ".join(parts))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.scoring.summary",
                                     description="One table for a recipe run directory: its eval reports with "
                                                 "the training runs behind them (writes summary.json and .md).")
    parser.add_argument("run_dir", type=Path, help="the recipe's OUT folder (with eval/ and train/ in it)")
    parser.add_argument("--goal", action="append", default=[], metavar="KEY=VALUE",
                        help="a goal to check (repeatable): DATASET=TAU, speedup=X, chats=N, minutes=M or mfu=P "
                             "(recipes/scoring/goals.py); prints a goals: line and writes summary_goals.json")
    parser.add_argument("--goal-run", default="main", help="the training run the goals judge (default: main)")
    args = parser.parse_args(argv)
    run_dir = args.run_dir
    try:
        goals = parse_goals(args.goal)
    except ValueError as error:
        print(f"summary: {error}", file=sys.stderr)
        return 2
    if not run_dir.is_dir():
        print(f"summary: {run_dir} is not a folder: give a recipe's OUT folder", file=sys.stderr)
        return 2
    report_regeneration(run_dir)  # before the table's checks: a run stopped before eval has its speed too
    data = data_line(run_dir)
    if data:
        print(data)
    for name, figures in training_figures(run_dir).items():
        print(training_line(name, figures))
    rows = summary_rows(run_dir)
    if not rows:
        print(f"summary: no eval reports under {run_dir / 'eval'}; run the eval stage first", file=sys.stderr)
        return 1
    table = markdown(rows)
    (run_dir / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    (run_dir / "summary.md").write_text(table)
    print(table, end="")
    for line in breakdown_lines(rows):
        print(line)
    if goals:
        checks = check_goals(goals, rows, run_dir, args.goal_run)
        print(goals_line(checks))
        write_goals(checks, run_dir / "summary_goals.json")
        sampling = check_sampling_goals(rows, args.goal_run)  # none without a sweep: apart from the goals
        if sampling:
            print(goals_line(sampling, "sampling goals (apart from the goals above)"))
            write_goals(sampling, run_dir / "summary_sampling_goals.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
