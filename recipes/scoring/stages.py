"""Minutes per stage of several recipe runs side by side, each against the first's: where more GPUs save time.

    python -m recipes.scoring.stages outputs/speedrun outputs/speedrun-8gpu      # prints a Markdown table
    python -m recipes.scoring.stages outputs/speedrun outputs/speedrun-8gpu --out stages.json

Each folder's `times.tsv` (one `stage<TAB>seconds` line per timed stage call, as the speedrun writes it) gives its
minutes per stage; a stage run in parts (killed and resumed, or split over calls) is the sum of its lines. The
first folder is the baseline: every other column reads `minutes (ratio)`, the ratio being the baseline's minutes
over this run's (2.00× is twice as fast). The total leaves out the extra stages (curve, ablate), as the speedrun's
minutes goal does. A column is headed with the GPUs its main run trained on, where its trainer state says.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from recipes.scoring.goals import EXTRA_STAGES, stage_seconds
from recipes.scoring.summary import training_state

TOTAL = "total"


def with_total(seconds: dict[str, float]) -> dict[str, float]:
    """Seconds per stage and their total, the extra stages left out of it."""
    return {**seconds, TOTAL: sum(s for stage, s in seconds.items() if stage not in EXTRA_STAGES)}


def gpus(run_dir: Path, run: str = "main") -> int | None:
    """The processes the folder's main run trained on, from its last trainer state (None without one)."""
    return training_state(run_dir / "train" / run).get("num_processes")


def compare(run_dirs: list[Path]) -> dict[str, Any]:
    """Minutes per stage of every folder and, for each after the first, the first's minutes over its own."""
    runs = [{"run": str(run_dir), "gpus": gpus(run_dir),
             "minutes": {stage: s / 60 for stage, s in with_total(stage_seconds(run_dir)).items()}} for run_dir in run_dirs]
    base = runs[0]["minutes"]
    for run in runs[1:]:
        run["speedup"] = {stage: base[stage] / minutes for stage, minutes in run["minutes"].items()
                          if stage in base and minutes > 0}
    return {"baseline": runs[0]["run"], "runs": runs}


def table(result: dict[str, Any]) -> str:
    """The Markdown table: one row per stage (in the order the folders first ran them), one column per run."""
    runs = result["runs"]
    stages = list(dict.fromkeys(s for run in runs for s in run["minutes"] if s != TOTAL)) + [TOTAL]
    head = [Path(run["run"]).name + (f" ({run['gpus']} GPU{'s' if run['gpus'] > 1 else ''})" if run["gpus"] else "")
            for run in runs]
    lines = ["| stage | " + " | ".join(head) + " |", "|---" * (len(runs) + 1) + "|"]
    for stage in stages:
        cells = []
        for run in runs:
            minutes = run["minutes"].get(stage)
            ratio = run.get("speedup", {}).get(stage)
            cell = "—" if minutes is None else f"{minutes:.1f}"
            cells.append(cell + (f" ({ratio:.2f}×)" if ratio is not None else ""))
        name = f"{TOTAL} (without {', '.join(EXTRA_STAGES)})" if stage == TOTAL else stage
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.scoring.stages",
                                     description="Minutes per stage of recipe run folders (their times.tsv), each "
                                                 "against the first's.")
    parser.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="a recipe's OUT folder; the first "
                        "is the baseline")
    parser.add_argument("--out", type=Path, help="also write the figures to this JSON file")
    parsed = parser.parse_args(argv)
    missing = [str(d) for d in parsed.run_dirs if not (d / "times.tsv").is_file()]
    if missing:
        print(f"stages: no times.tsv in {', '.join(missing)}: give recipe OUT folders that ran a stage",
              file=sys.stderr)
        return 2
    try:
        result = compare(parsed.run_dirs)
    except ValueError as error:
        print(f"stages: {error}", file=sys.stderr)
        return 1
    print(table(result), end="")
    if parsed.out:
        parsed.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"written: {parsed.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
