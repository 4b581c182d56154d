"""A recipe run's goals, checked against what it measured: one "goals:" line and `summary_goals.json`.

    python -m recipes.scoring.summary OUT --goal mt-bench=4.0 --goal speedup=2.0 --goal chats=150000 --goal minutes=25

A goal is `KEY=VALUE`. Four keys are reserved; every other key names an eval set:
- `DATASET=TAU`: τ of the headline run (batch 1, bf16) on that set, at least TAU;
- `speedup=X`: its decode speedup over the target alone, at least X on every set it was measured on;
- `chats=N`: the chats training kept (`prepared/dflash_data.json`), at least N;
- `minutes=M`: the stages' wall time (`times.tsv`; the extra curve and ablate stages not counted), at most M;
- `mfu=P`: the judged training run's whole-step MFU in percent (the median of `step_mfu` over its logged steps
  after the first, whose compilation says nothing of the step; `train/RUN/metrics.jsonl`), at least P.
A goal whose figure the run folder lacks is reported as not measured, not as missed.

Apart from these, a headline report of a temperature sweep (`dflash-train eval --temperature 0,0.7,1`) is
checked against the sampling goals (SAMPLING_GOALS): τ at 0.7 keeps at least 85 % of the greedy τ and τ at 1
at least 75 %, on every set. They are a separate "sampling goals:" line and `summary_sampling_goals.json`, and
leave the goals above and their count as they are.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

EXTRA_STAGES = ("curve", "ablate")  # timed in times.tsv, but not part of a run's own minutes
# (temperature, the least share of the greedy τ it keeps on every set): a drafter worth serving when chats sample
SAMPLING_GOALS = ((0.7, 0.85), (1.0, 0.75))


@dataclass(frozen=True)
class GoalCheck:
    name: str  # "τ mt-bench", "speedup", "chats", "minutes", "MFU", "τ(T=0.7) / τ(T=0)"
    goal: float
    value: float | None  # None: not measured in this run folder
    at_most: bool = False  # the goal is an upper bound (minutes)
    detail: str = ""  # which set a speedup's lowest value came from

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value <= self.goal if self.at_most else self.value >= self.goal


def parse_goals(specs: list[str]) -> dict[str, float]:
    """`["mt-bench=4.0", "chats=150000"]` -> {"mt-bench": 4.0, "chats": 150000.0}; a bad one is a ValueError."""
    goals = {}
    for spec in specs:
        key, sep, value = (part.strip() for part in spec.partition("="))
        try:
            number = float(value) if sep and key else None
        except ValueError:
            number = None
        if number is None:
            raise ValueError(f"goal '{spec}' is not KEY=NUMBER (e.g. mt-bench=4.0, speedup=2, chats=150000, "
                             "minutes=25)")
        goals[key] = number
    return goals


def headline_rows(rows: list[dict[str, Any]], run: str) -> list[dict[str, Any]]:
    """The summary rows the goals are judged on: run `run` at batch 1 in bf16 (the speedrun's own setting)."""
    return [r for r in rows if r["run"] == run and r["batch"] == 1 and r["dtype"] == "bfloat16"]


def kept_chats(run_dir: Path) -> float | None:
    path = run_dir / "prepared" / "dflash_data.json"
    return float(json.loads(path.read_text())["counts"]["kept"]) if path.is_file() else None


def stage_seconds(run_dir: Path) -> dict[str, float]:
    """Seconds per stage of `run_dir/times.tsv` (stage, seconds per line), the parts of a stage run in parts
    summed, in the order the stages first ran; a line that is no stage and number is refused in one line."""
    seconds: dict[str, float] = {}
    for number, line in enumerate((run_dir / "times.tsv").read_text().splitlines(), start=1):
        if not line.strip():
            continue
        stage, _, value = line.partition("\t")
        try:
            spent = float(value)
        except ValueError:
            spent = math.nan
        if not stage or not math.isfinite(spent):
            raise ValueError(f"{run_dir / 'times.tsv'} line {number} is not 'stage<TAB>seconds': {line!r}")
        seconds[stage] = seconds.get(stage, 0.0) + spent
    return seconds


def stage_minutes(run_dir: Path) -> float | None:
    """The total of `times.tsv` in minutes, the extra stages left out (None without the file)."""
    if not (run_dir / "times.tsv").is_file():
        return None
    return sum(s for stage, s in stage_seconds(run_dir).items() if stage not in EXTRA_STAGES) / 60


def logged_train_steps(train_dir: Path) -> list[dict[str, Any]]:
    """A training run's logged train records (`metrics.jsonl`), in order; none without the file."""
    path = train_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("split") == "train"]


def median(values: list[float]) -> float | None:
    """The upper median (a logged value), None for none: the figure the summary prints."""
    return sorted(values)[len(values) // 2] if values else None


def whole_step_mfu(run_dir: Path, run: str) -> float | None:
    """Training run `run`'s median whole-step MFU in percent, the cold first log left out, as the summary's
    `training:` line gives it (None without logged steps)."""
    value = median([r["step_mfu"] for r in logged_train_steps(run_dir / "train" / run)[1:] if "step_mfu" in r])
    return None if value is None else 100 * value


def check_goals(goals: dict[str, float], rows: list[dict[str, Any]], run_dir: Path, run: str = "main"
                ) -> list[GoalCheck]:
    """Each goal against the run folder's figures, in the order given."""
    headline = headline_rows(rows, run)
    checks = []
    for key, goal in goals.items():
        if key == "speedup":
            measured = [(r["speedup"], r["dataset"]) for r in headline if r.get("speedup") is not None]
            lowest = min(measured) if measured else (None, "")
            checks.append(GoalCheck("speedup", goal, lowest[0], detail=lowest[1]))
        elif key == "chats":
            checks.append(GoalCheck("chats", goal, kept_chats(run_dir)))
        elif key == "minutes":
            checks.append(GoalCheck("minutes", goal, stage_minutes(run_dir), at_most=True))
        elif key == "mfu":
            checks.append(GoalCheck("MFU", goal, whole_step_mfu(run_dir, run)))
        else:
            tau = next((r["tau"] for r in headline if r["dataset"] == key), None)
            checks.append(GoalCheck(f"τ {key}", goal, tau))
    return checks


def check_sampling_goals(rows: list[dict[str, Any]], run: str = "main") -> list[GoalCheck]:
    """SAMPLING_GOALS against the headline rows' temperature sweep: each goal's value is the lowest share of the
    greedy τ over the sets (the set named in `detail`), not measured where the sweep lacks that temperature or
    0. Empty when the headline report is not a sweep."""
    swept = [r for r in headline_rows(rows, run) if r.get("temperature_sweep")]
    if not swept:
        return []
    checks = []
    for temperature, share in SAMPLING_GOALS:
        shares = [(point["fraction_of_greedy"], r["dataset"]) for r in swept for point in r["temperature_sweep"]
                  if math.isclose(point["temperature"], temperature) and point["fraction_of_greedy"] is not None]
        lowest = min(shares) if len(shares) == len(swept) else (None, "")  # every set, or not measured
        checks.append(GoalCheck(f"τ(T={temperature:g}) / τ(T=0)", share, lowest[0], detail=lowest[1]))
    return checks


def _number(name: str, value: float) -> str:
    if name.endswith("/ τ(T=0)"):
        return f"{value:.1%}"
    if name == "chats":
        return f"{value:,.0f}"
    if name == "speedup":
        return f"{value:.2f}×"
    if name == "MFU":
        return f"{value:.1f} %"
    return f"{value:.1f}" if name == "minutes" else f"{value:.2f}"


def goals_line(checks: list[GoalCheck], label: str = "goals") -> str:
    """`goals: τ mt-bench 4.13 ≥ 4.00 ✓ · … — 3 of 6 met` (`label` in place of "goals")."""
    parts = []
    for c in checks:
        goal = _number(c.name, c.goal)
        if c.met is None:
            parts.append(f"{c.name} not measured (goal {'≤' if c.at_most else '≥'} {goal})")
            continue
        relation = ("≤" if c.met else ">") if c.at_most else ("≥" if c.met else "<")
        lowest = f" (lowest, {c.detail})" if c.detail else ""
        parts.append(f"{c.name} {_number(c.name, c.value)}{lowest} {relation} {goal} {'✓' if c.met else '✗'}")
    met = sum(c.met is True for c in checks)
    return f"{label}: {' · '.join(parts)} — {met} of {len(checks)} met"


def write_goals(checks: list[GoalCheck], path: Path) -> None:
    path.write_text(json.dumps([{**asdict(c), "met": c.met} for c in checks], indent=2, ensure_ascii=False) + "\n")
