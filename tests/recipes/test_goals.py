"""A run's goals are judged on its headline setting (batch 1, bf16, the named run) and its own figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipes.scoring.goals import check_goals, check_sampling_goals, goals_line, parse_goals, stage_minutes
from recipes.scoring.summary import main, summary_rows
from tests.helpers.eval_reports import result, sweep_section, write_report


def make_run(root: Path) -> Path:
    """main at batch 1: τ 4.2 (MT-Bench, speedup 2.5), 3.9 (HumanEval, 1.8); the batch-8 and float32 reports and
    an ablation carry better figures that must not count. 140,000 chats kept; stages 600 + 780 s, plus a curve."""
    mt, he = result(4.2, True, speedup=2.5), result(3.9, True, speedup=1.8)
    write_report(root / "eval" / "main-b16.json", 16, {"mt-bench": mt, "humaneval": he})
    write_report(root / "eval" / "main-b8.json", 16, {"humaneval": result(9.0, True, speedup=9.0)}, batch=8)
    write_report(root / "eval" / "main-fp32.json", 16, {"humaneval": result(9.0, True)}, dtype="float32")
    write_report(root / "eval" / "ablation-x-b16.json", 16, {"humaneval": result(9.0, True, speedup=9.0)})
    (root / "prepared").mkdir()
    (root / "prepared" / "dflash_data.json").write_text(json.dumps({"counts": {
        "kept": 140000, "read": 150000, "tokens": 1, "supervised tokens": 1, "dropped": {}}}))
    (root / "times.tsv").write_text("prompts\t600\ntrain\t780\ncurve\t3000\n")
    return root


def test_goals_use_the_headline_rows_and_the_run_folder(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    goals = parse_goals(["mt-bench=4.0", "humaneval=4.5", "speedup=2", "chats=150000", "minutes=25", "math=5.5"])
    checks = {c.name: c for c in check_goals(goals, summary_rows(run), run)}
    assert checks["τ mt-bench"].value == 4.2 and checks["τ mt-bench"].met is True
    assert checks["τ humaneval"].value == 3.9 and checks["τ humaneval"].met is False  # not the batch-8 9.0
    assert (checks["speedup"].value, checks["speedup"].detail, checks["speedup"].met) == (1.8, "humaneval", False)
    assert checks["chats"].value == 140000 and checks["chats"].met is False
    assert checks["minutes"].value == pytest.approx(23.0) and checks["minutes"].met is True  # the curve left out
    assert checks["τ math"].value is None and checks["τ math"].met is None  # never evaluated: not measured


def test_goals_line_reads_each_goal_and_counts_the_met_ones(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    checks = check_goals(parse_goals(["mt-bench=4", "speedup=2", "minutes=20", "math=5.5"]), summary_rows(run), run)
    assert goals_line(checks) == ("goals: τ mt-bench 4.20 ≥ 4.00 ✓ · speedup 1.80× (lowest, humaneval) < 2.00× ✗ · "
                                  "minutes 23.0 > 20.0 ✗ · τ math not measured (goal ≥ 5.50) — 1 of 4 met")


def test_another_run_can_be_judged(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    checks = check_goals({"humaneval": 4.5}, summary_rows(run), run, run="ablation-x")
    assert checks[0].value == 9.0 and checks[0].met is True


@pytest.mark.parametrize("spec", ["mt-bench", "mt-bench=", "=4", "speedup=fast"])
def test_a_malformed_goal_is_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="is not KEY=NUMBER"):
        parse_goals([spec])


def test_missing_times_are_not_measured(tmp_path: Path) -> None:
    assert stage_minutes(tmp_path) is None


def test_summary_prints_the_goals_line_and_writes_its_file(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    run = make_run(tmp_path)
    assert main([str(run), "--goal", "mt-bench=4.0", "--goal", "chats=150000"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "goals: τ mt-bench 4.20 ≥ 4.00 ✓ · chats 140,000 < 150,000 ✗ — 1 of 2 met")
    written = json.loads((run / "summary_goals.json").read_text())
    assert [(g["name"], g["met"]) for g in written] == [("τ mt-bench", True), ("chats", False)]
    assert not (run / "summary_sampling_goals.json").exists()  # no sweep: no sampling goals


def test_summary_refuses_a_bad_goal_in_one_line(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    assert main([str(make_run(tmp_path)), "--goal", "speedup"]) == 2
    assert capsys.readouterr().err.strip() == ("summary: goal 'speedup' is not KEY=NUMBER (e.g. mt-bench=4.0, "
                                               "speedup=2, chats=150000, minutes=25)")


def swept_run(root: Path, temperatures: list[float], mt_bench: list[float], humaneval: list[float]) -> Path:
    """make_run's folder with main's batch-1 report a sweep (its own figures the lowest temperature's), and a
    batch-8 sweep that keeps all of its greedy τ, which must not count."""
    run = make_run(root)
    sweep = sweep_section(temperatures, {"mt-bench": mt_bench, "humaneval": humaneval})
    write_report(run / "eval" / "main-b16.json", 16, {"mt-bench": result(mt_bench[0], True, speedup=2.5),
                                                      "humaneval": result(humaneval[0], True, speedup=1.8)},
                 temperature_sweep=sweep)
    write_report(run / "eval" / "main-b8.json", 16, {"humaneval": result(4.0, True)}, batch=8,
                 temperature_sweep=sweep_section([0.0, 0.7, 1.0], {"humaneval": [4.0, 4.0, 4.0]}))
    return run


def test_sampling_goals_take_the_lowest_share_of_the_greedy_tau_over_the_sets(tmp_path: Path) -> None:
    """τ(0.7) ≥ 85 % and τ(1) ≥ 75 % of τ(0) on every set: MT-Bench keeps 4.2 → 3.5 (83.3 %) and 3.2 (76.2 %),
    HumanEval 3.9 → 3.51 (90 %) and 3.12 (80 %); the lowest decides each."""
    run = swept_run(tmp_path, [0.0, 0.7, 1.0], [4.2, 3.5, 3.2], [3.9, 3.51, 3.12])
    checks = check_sampling_goals(summary_rows(run))
    assert [(c.name, c.goal, c.detail, c.met) for c in checks] == [
        ("τ(T=0.7) / τ(T=0)", 0.85, "mt-bench", False), ("τ(T=1) / τ(T=0)", 0.75, "mt-bench", True)]
    assert checks[0].value == pytest.approx(3.5 / 4.2) and checks[1].value == pytest.approx(3.2 / 4.2)
    assert goals_line(checks, "sampling goals") == (
        "sampling goals: τ(T=0.7) / τ(T=0) 83.3% (lowest, mt-bench) < 85.0% ✗ · "
        "τ(T=1) / τ(T=0) 76.2% (lowest, mt-bench) ≥ 75.0% ✓ — 1 of 2 met")


def test_sampling_goals_are_a_line_apart_that_leaves_the_goals_as_they_were(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    run = swept_run(tmp_path, [0.0, 0.7, 1.0], [4.2, 3.78, 3.36], [4.0, 3.8, 3.4])  # MT-Bench keeps 90 % and 80 %
    assert main([str(run), "--goal", "mt-bench=4.0", "--goal", "chats=150000"]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == [
        "goals: τ mt-bench 4.20 ≥ 4.00 ✓ · chats 140,000 < 150,000 ✗ — 1 of 2 met",
        "sampling goals (apart from the goals above): τ(T=0.7) / τ(T=0) 90.0% (lowest, mt-bench) ≥ 85.0% ✓ · "
        "τ(T=1) / τ(T=0) 80.0% (lowest, mt-bench) ≥ 75.0% ✓ — 2 of 2 met"]
    assert [g["name"] for g in json.loads((run / "summary_goals.json").read_text())] == ["τ mt-bench", "chats"]
    written = json.loads((run / "summary_sampling_goals.json").read_text())
    assert [(g["name"], g["goal"], g["met"]) for g in written] == [
        ("τ(T=0.7) / τ(T=0)", 0.85, True), ("τ(T=1) / τ(T=0)", 0.75, True)]


def test_a_sweep_without_a_temperature_or_greedy_leaves_its_goal_not_measured(tmp_path: Path) -> None:
    no_one = check_sampling_goals(summary_rows(swept_run(tmp_path / "a", [0.0, 0.7], [4.0, 3.6], [3.0, 2.7])))
    assert [(c.name, c.value is None) for c in no_one] == [("τ(T=0.7) / τ(T=0)", False), ("τ(T=1) / τ(T=0)", True)]
    assert goals_line(no_one).endswith("τ(T=1) / τ(T=0) not measured (goal ≥ 75.0%) — 1 of 2 met")
    no_greedy = check_sampling_goals(summary_rows(swept_run(tmp_path / "b", [0.7, 1.0], [4.0, 3.6], [3.0, 2.7])))
    assert all(c.met is None for c in no_greedy)
    assert check_sampling_goals(summary_rows(make_run(tmp_path / "c"))) == []  # no sweep: no sampling goals


def write_metrics(run: Path, name: str, step_mfus: list[float]) -> None:
    """A training run's metrics.jsonl: a validation record and one train record per MFU (the first the cold one)."""
    folder = run / "train" / name
    folder.mkdir(parents=True)
    records = [{"step": 0, "split": "validation", "loss": 1.0}]
    records += [{"step": 10 * (i + 1), "split": "train", "step_mfu": m} for i, m in enumerate(step_mfus)]
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")


def test_the_mfu_goal_is_the_median_logged_step_after_the_first(tmp_path: Path) -> None:
    """The first logged step (compilation) is left out; the median of the rest (the upper one, as the summary's
    training line), in percent, against the goal, for the judged run only; a run without metrics is not measured."""
    run = make_run(tmp_path)
    write_metrics(run, "main", [0.02, 0.29, 0.33, 0.31, 0.30])  # the last four's upper median: 31 %
    write_metrics(run, "ablation-x", [0.02, 0.10, 0.10])
    checks = check_goals(parse_goals(["mfu=30"]), summary_rows(run), run)
    assert checks[0].value == pytest.approx(31.0) and checks[0].met is True
    assert goals_line(checks) == "goals: MFU 31.0 % ≥ 30.0 % ✓ — 1 of 1 met"
    other = check_goals({"mfu": 30.0}, summary_rows(run), run, run="ablation-x")[0]
    assert other.value == pytest.approx(10.0) and other.met is False
    missing = check_goals({"mfu": 30.0}, summary_rows(run), run, run="curve-5min")[0]
    assert missing.value is None and missing.met is None
