"""τ against training minutes, from a run directory's training states and eval reports."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from recipes.scoring.curve import (
    curve_points,
    goal_lines,
    log_minutes,
    main,
    minutes_to_goal,
    tau_per_doubling,
)
from tests.helpers.eval_reports import result, write_report


def trained(run_dir: Path, name: str, minutes: float, step: int, gpus: int | None = None) -> None:
    """A finished run's last trainer state; `gpus` None leaves the process count out, as older states do."""
    state = run_dir / "train" / name / "checkpoints" / f"step-{step:08d}"
    state.mkdir(parents=True)
    launch = {} if gpus is None else {"num_processes": gpus}
    (state / "trainer_state.json").write_text(json.dumps({"step": step, "sequences_seen": step * 16,
                                                          "train_seconds": minutes * 60, **launch}))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    trained(tmp_path, "curve-10min", 10, 2000)
    trained(tmp_path, "curve-5min", 5, 1000)
    trained(tmp_path, "main", 20, 4000)
    write_report(tmp_path / "eval" / "curve-10min-b16.json", 16, {"mt-bench": result(2.0, True, speedup=1.2),
                                                                  "humaneval": result(2.5, True, speedup=1.4)})
    write_report(tmp_path / "eval" / "curve-5min-b16.json", 16, {"mt-bench": result(1.5, True, speedup=0.9)},
                 dtype="float32")  # a CPU run's default precision
    write_report(tmp_path / "eval" / "main-b16.json", 16, {"mt-bench": {**result(3.0, True, speedup=1.8),
                                                                    "acceptance_length_ci95": [2.7, 3.2]}})
    # Not points: a block-8 repeat of main, a float32 check, a batch-8 eval, a report of no training run.
    write_report(tmp_path / "eval" / "main-b8.json", 8, {"mt-bench": result(2.6, True)})
    write_report(tmp_path / "eval" / "main-fp32.json", 16, {"mt-bench": result(3.1, True)}, dtype="float32")
    write_report(tmp_path / "eval" / "curve-5min-x.json", 16, {"mt-bench": result(9.0, True)}, batch=8)
    write_report(tmp_path / "eval" / "elsewhere.json", 16, {"mt-bench": result(9.0, True)})
    return tmp_path


def test_points_are_batch_one_reports_at_the_largest_block_sorted_by_minutes(run_dir: Path) -> None:
    points = [(p["train_minutes"], p["run"], p["dataset"], p["tau"], p["speedup"]) for p in curve_points(run_dir)]
    assert points == [(5.0, "curve-5min", "mt-bench", 1.5, 0.9), (10.0, "curve-10min", "humaneval", 2.5, 1.4),
                      (10.0, "curve-10min", "mt-bench", 2.0, 1.2), (20.0, "main", "mt-bench", 3.0, 1.8)]
    # main's interval is drawn as its error bar; the older reports have none
    assert [p["tau_ci95"] for p in curve_points(run_dir)] == [None, None, None, [2.7, 3.2]]


def test_main_writes_the_table_json_and_plot(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "| 20 | 1 | 20.0 | main | mt-bench | 3.00 | 3.50 | 1.80× | 4000 |" in out
    assert [p["run"] for p in json.loads((run_dir / "curve.json").read_text())] == [
        "curve-5min", "curve-10min", "curve-10min", "main"]
    assert (run_dir / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "τ per doubling of GPU-minutes (least squares over the reference runs' budgets): mt-bench +0.75" in out


def test_nothing_to_plot_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path)]) == 1
    assert "run the train and eval stages first" in capsys.readouterr().err


def test_files_it_did_not_write_are_not_overwritten(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run_dir / "curve.png").write_bytes(b"a user's figure")
    assert main([str(run_dir)]) == 1
    assert "not written by this command" in capsys.readouterr().err
    assert (run_dir / "curve.png").read_bytes() == b"a user's figure"
    (run_dir / "curve.png").unlink()
    (run_dir / "curve.json").write_text('{"notes": "mine"}')
    assert main([str(run_dir)]) == 1
    assert (run_dir / "curve.json").read_text() == '{"notes": "mine"}'
    (run_dir / "curve.json").unlink()
    assert main([str(run_dir)]) == 0 and main([str(run_dir)]) == 0  # its own output is replaced


def test_runs_of_several_directories_make_one_curve(run_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A longer run trained elsewhere (its own directory, its own `main`) joins the curve, written to the first."""
    other = tmp_path_factory.mktemp("later")
    trained(other, "main", 40, 8000)
    write_report(other / "eval" / "main-b16.json", 16, {"mt-bench": result(3.5, True, speedup=2.0)})
    assert main([str(run_dir), str(other)]) == 0
    runs = [(p["train_minutes"], p["run"]) for p in json.loads((run_dir / "curve.json").read_text())
            if p["dataset"] == "mt-bench"]
    assert runs == [(5.0, f"{run_dir.name}/curve-5min"), (10.0, f"{run_dir.name}/curve-10min"),
                    (20.0, f"{run_dir.name}/main"), (40.0, f"{other.name}/main")]
    assert not (other / "curve.json").exists()
    assert f"| 40 | 1 | 40.0 | {other.name}/main | mt-bench | 3.50 |" in capsys.readouterr().out


def test_run_directories_of_one_name_are_refused(run_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    twin = tmp_path_factory.mktemp("twin") / run_dir.name
    twin.mkdir()
    assert main([str(run_dir), str(twin)]) == 2
    assert "need different names" in capsys.readouterr().err


def test_no_folder_is_a_usage_error_and_a_missing_one_a_one_line_error(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([])
    assert exited.value.code == 2 and "RUN_DIR" in capsys.readouterr().err
    assert main([str(tmp_path), str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / 'nowhere'} is not a folder" in err


def test_the_minutes_axis_is_logarithmic_once_budgets_span_a_doubling() -> None:
    assert log_minutes([5.0, 10.0, 20.0]) and log_minutes([9.0, 20.0])
    assert not log_minutes([9.0, 12.0]) and not log_minutes([0.0, 9.0]) and not log_minutes([])


def test_tau_per_doubling_is_the_least_squares_slope_against_log2_minutes(run_dir: Path) -> None:
    # MT-Bench at 5, 10 and 20 minutes: τ 1.5, 2.0, 3.0. Against log2 minutes the points sit at -1, 0, +1 around
    # their mean, so the slope is (-1 * -2/3 + 0 + 1 * 5/6) / 2 = 0.75; HumanEval has one budget: no slope.
    assert tau_per_doubling(curve_points(run_dir)) == pytest.approx({"mt-bench": 0.75})
    one_budget = [{"dataset": "math", "gpus": 1, "gpu_minutes": 9.0, "tau": tau} for tau in (4.0, 4.2)]
    assert tau_per_doubling(one_budget) == {}


def test_minutes_to_goal_follow_the_trend_line(run_dir: Path) -> None:
    # MT-Bench's line: τ 2.9167 at 20 minutes (its fit), +0.75 a doubling; τ 3.75 is 0.8333 / 0.75 = 1.111
    # doublings later: 20 · 2^1.111 = 43.2 minutes. HumanEval has one budget: no trend.
    reach = minutes_to_goal(curve_points(run_dir), {"mt-bench": 3.75, "humaneval": 3.0})
    assert reach["mt-bench"] == pytest.approx(20 * 2 ** (0.8333333 / 0.75), rel=1e-5)
    assert reach["humaneval"] is None
    lines = goal_lines(curve_points(run_dir), {"mt-bench": 3.75, "humaneval": 3.0})
    assert lines == ["mt-bench: τ 3.75 at about 43 GPU-minutes if τ keeps rising as it has",
                     "humaneval: τ 3.00 not reached, and no rising trend over two budgets or more"]
    assert goal_lines(curve_points(run_dir), {"mt-bench": 2.0}) == [
        "mt-bench: τ 2.00 reached at 10 GPU-minutes (measured)"]


def test_goals_on_the_command_line(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(run_dir), "--goal", "mt-bench=3.75", "--goal", "gsm8k=3"]) == 0
    captured = capsys.readouterr()
    assert "mt-bench: τ 3.75 at about 43 GPU-minutes" in captured.out
    assert captured.err.count("\n") == 1 and "no points of gsm8k" in captured.err
    assert (run_dir / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for bad in ("mt-bench", "mt-bench=fast", "mt-bench=0.5"):
        with pytest.raises(SystemExit) as exit_info:
            main([str(run_dir), "--goal", bad])
        assert exit_info.value.code == 2
        assert "is not DATASET=TAU with TAU > 1" in capsys.readouterr().err


def test_a_run_on_eight_gpus_is_a_point_at_its_gpu_minutes_against_the_one_gpu_curve(
        run_dir: Path, tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]) -> None:
    """An 8-GPU run of 3 minutes sits at 24 GPU-minutes. The trend stays the one-GPU runs' (τ 2.9167 at 20
    minutes, +0.75 a doubling): at 24 it gives 2.9167 + 0.75 · log2(1.2) = 3.1140, and the run's τ 3.5 is
    0.386 above it. The run that reaches a goal first is named with its GPUs."""
    eight = tmp_path_factory.mktemp("eight")
    trained(eight, "main", 3, 600, gpus=8)
    write_report(eight / "eval" / "main-b16.json", 16, {"mt-bench": result(3.5, True, speedup=2.1)})
    assert main([str(run_dir), str(eight), "--goal", "mt-bench=3.2"]) == 0
    out = capsys.readouterr().out
    points = json.loads((run_dir / "curve.json").read_text())
    assert [(p["gpus"], p["gpu_minutes"]) for p in points if p["dataset"] == "mt-bench"] == [
        (1, 5.0), (1, 10.0), (1, 20.0), (8, 24.0)]
    assert tau_per_doubling(points) == pytest.approx({"mt-bench": 0.75})  # the 8-GPU point leaves the trend alone
    expected = 2.9166667 + 0.75 * math.log2(1.2)
    assert f"{eight.name}/main (8 GPUs, 24 GPU-minutes), mt-bench: τ 3.50 against {expected:.2f} on the curve " \
           f"(+{3.5 - expected:.2f})" in out
    assert "mt-bench: τ 3.20 reached at 24 GPU-minutes (measured, on 8 GPUs)" in out
    assert f"| 24 | 8 | 3.0 | {eight.name}/main | mt-bench | 3.50 |" in out
    assert (run_dir / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
