"""`benchmarks/train_scaling.py`: chat-passes a minute read from a run's metrics.jsonl (checked by hand on a
written file), scaling and the goal's mark, the one-line refusals of wrong arguments, a re-run that launches
only what has not finished, and the whole benchmark on one and two CPU processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import multi_gpu, train_scaling
from benchmarks.multi_gpu import Runs
from benchmarks.train_scaling import add_scaling, faster, goal_mark, launch_run, main, measure
from dflash_train.training.tracking import read_metrics
from tests.helpers.paths import REPO


def write_metrics(run: Path, rows: list[dict[str, Any]]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"split": "train", **row}) for row in rows]
    lines.insert(1, json.dumps({"split": "validation", "step": 10, "loss": 1.0}))  # not a training row
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


ROWS = [{"step": 10, "step_seconds": 2.0, "chats_seen": 100, "tokens": 1000.0},  # compilation: the warm-up
        {"step": 20, "step_seconds": 0.5, "chats_seen": 180, "tokens": 1100.0},
        {"step": 30, "step_seconds": 0.4, "chats_seen": 270, "tokens": 1200.0}]


def test_chat_passes_a_minute_skip_the_warm_up_rows(tmp_path: Path) -> None:
    write_metrics(tmp_path / "run", ROWS)
    # --warmup 0.4 of 30 steps = step 12: the row of step 10 is the warm-up's last. After it, steps 11..20 took
    # 0.5 s each and 21..30 0.4 s: 9 s for 270 - 100 = 170 chats, 60 * 170 / 9 chat-passes a minute.
    result = measure(tmp_path / "run", steps=30, warmup=0.4)
    assert result["window"] == [10, 30] and result["window_chats"] == 170
    assert result["window_seconds"] == pytest.approx(9.0)
    assert result["chat_passes_per_min"] == pytest.approx(1133.333, rel=1e-6)
    assert result["tokens_per_s"] == pytest.approx((1100 * 10 + 1200 * 10) / 9)  # each logged step's tokens x 10
    assert result["median_step_s"] == pytest.approx(0.45) and result["chats_per_step"] == pytest.approx(9.0)
    assert result["first_step_s"] is None and result["wall_s"] is None  # no launch record, step 1 not logged
    # No warm-up: from step 0 (no chats yet), 2 * 10 + 0.5 * 10 + 0.4 * 10 = 29 s for 270 chats.
    assert measure(tmp_path / "run", steps=30, warmup=0)["chat_passes_per_min"] == pytest.approx(60 * 270 / 29)


def test_the_first_step_and_the_wall_time_come_from_the_launch_record(tmp_path: Path) -> None:
    write_metrics(tmp_path / "run", [{"step": 1, "step_seconds": 30.0, "chats_seen": 9, "tokens": 900.0}, *ROWS])
    assert measure(tmp_path / "run", 30, 0.4)["first_step_s"] == 30.0  # the first logged row is step 1
    (tmp_path / "run" / "launch.json").write_text(json.dumps({"wall_seconds": 95.0, "first_step_seconds": 28.5}))
    result = measure(tmp_path / "run", 30, 0.4)
    assert (result["first_step_s"], result["wall_s"]) == (28.5, 95.0)
    assert result["chat_passes_per_min"] == pytest.approx(1133.333, rel=1e-6)  # step 1 is in the warm-up


def test_scaling_efficiency_and_the_goal() -> None:
    results: dict[str, dict[int, dict[str, Any]]] = {
        "ddp": {1: {"chat_passes_per_min": 100.0}, 2: {"chat_passes_per_min": 190.0}, 8: {"chat_passes_per_min": 720.0}},
        "fsdp2": {2: {"chat_passes_per_min": 200.0}, 8: {"chat_passes_per_min": 650.0}}}  # its baseline failed
    add_scaling(results)
    assert results["ddp"][2]["scaling"] == pytest.approx(1.9) and results["ddp"][2]["efficiency"] == pytest.approx(0.95)
    assert results["ddp"][8]["scaling"] == pytest.approx(7.2) and results["ddp"][8]["efficiency"] == pytest.approx(0.9)
    assert results["fsdp2"][2]["scaling"] is None and results["fsdp2"][2]["efficiency"] is None
    assert faster(results) == {2: "fsdp2", 8: "ddp"}  # 1 GPU ran under ddp only: nothing to compare
    assert goal_mark(8, 7.2) == "≥ 7× ✓" and goal_mark(8, 6.99) == "≥ 7× ✗"
    assert goal_mark(4, 3.9) == "" and goal_mark(8, None) == ""


def test_each_run_times_the_recipe_without_validation_or_checkpoints_on_the_way() -> None:
    args = train_scaling.parse_args(["--cpu", "--steps", "8", "--set", "training.num_anchors=16"])
    train_scaling.check_args(args)
    assert (args.launch, args.gpus, args.log_every) == (["ddp"], [1, 2], 1)
    settings = train_scaling.overrides(args, Path("t"), Path("p"), "ddp")
    for setting in ("data.validation_fraction=0", "training.eval_every=0", "training.resume=none",
                    "training.time_budget_minutes=null", "training.max_steps=8", "training.log_every=1",
                    "tracking.report_to=none", "model.mask_token_id=16", "training.compile=false"):
        assert setting in settings
    assert settings[-1] == "training.num_anchors=16"  # --set last: it wins
    # Muon refuses FSDP's sharded weights: fsdp2 runs AdamW, and the other launch configs keep the recipe's
    assert "training.optimizer=adamw" in train_scaling.overrides(args, Path("t"), Path("p"), "fsdp2")
    assert not any(s.startswith("training.optimizer") for s in settings)


@pytest.mark.parametrize(("argv", "message"), [
    (["--cpu", "--launch", "ddp,zero3"], "--launch: unknown launch config 'zero3'; choose from ddp$"),
    (["--cpu", "--launch", "fsdp2"], r"unknown launch config 'fsdp2' on --cpu \(FSDP needs CUDA\); choose from ddp"),
    (["--launch", "ddp,zero2"], "unknown launch config 'zero2'; choose from ddp, fsdp2"),
    (["--cpu", "--gpus", "1,0"], "--gpus: '0' is not a whole number of processes"),
    (["--cpu", "--gpus", "1,two"], "--gpus: 'two' is not a whole number of processes"),
    (["--cpu", "--gpus", "1.5"], "--gpus: '1.5' is not a whole number of processes"),
    (["--gpus", "1,2,4"], "--gpus: 4 GPUs asked for and this machine has 2 CUDA devices"),
    (["--cpu", "--target", "somewhere"], "--target and --prepared go together"),
    (["--cpu", "--warmup", "1"], "--warmup is a fraction of the steps"),
])
def test_mistakes_are_refused_in_one_line(argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(train_scaling.torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit, match=message) as refused:
        main(argv)
    assert "\n" not in str(refused.value.code)


def test_a_finished_run_is_not_launched_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    launched: list[list[str]] = []

    class Failing:  # a launch's process that records its command and fails at once: nothing trains
        def __init__(self, command: list[str], **_: Any) -> None:
            launched.append(command)

        def wait(self, timeout: float) -> int:
            return 3

    monkeypatch.setattr(multi_gpu.subprocess, "Popen", Failing)
    runs = Runs(tmp_path, [], steps=30, env={}, deadline=float("inf"))
    write_metrics(tmp_path / "ddp-1", ROWS)  # reached step 30: done
    write_metrics(tmp_path / "ddp-2", ROWS[:2])  # cut short at step 20
    write_metrics(tmp_path / "ddp-4", [*ROWS, {**ROWS[-1], "step": 40}])  # a benchmark of 40 steps
    for processes in (1, 2, 4):
        launch_run(runs, "ddp", processes, cpu=True, settings=[])
    assert [command[command.index("--num_processes") + 1] for command in launched] == ["2", "4"]
    assert (tmp_path / "ddp-1" / "metrics.jsonl").exists()
    # the others started over in empty folders (resume=none), and their failures are recorded
    assert not (tmp_path / "ddp-2").exists() and not (tmp_path / "ddp-4").exists()
    assert set(runs.failed) == {"ddp-2", "ddp-4"} and runs.failed["ddp-2"].startswith("exit 3")


@pytest.mark.slow
def test_one_and_two_cpu_processes_end_to_end(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "DFLASH_BENCH_RESULTS": str(tmp_path)}
    command = [sys.executable, "-m", "benchmarks.train_scaling", "--cpu", "--gpus", "1,2", "--steps", "4",
               "--workdir", str(tmp_path / "work")]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads((tmp_path / "train_scaling.json").read_text())
    runs = result["runs"]["ddp"]
    assert set(runs) == {"1", "2"} and all(run["chat_passes_per_min"] > 0 for run in runs.values())
    assert runs["1"]["scaling"] == 1.0 and runs["2"]["scaling"] > 0 and not result["failed"]
    # Weak scaling: each process trains on the recipe's batch, so a two-process step takes the packed rows of
    # two one-process steps (the rows are the same on any number of processes): both ranks trained.
    one, two = (read_metrics(tmp_path / "work" / name / "metrics.jsonl")["train"] for name in ("ddp-1", "ddp-2"))
    assert [row["chats_seen"] for row in two[:2]] == [one[1]["chats_seen"], one[3]["chats_seen"]]
    assert "ddp        2" in proc.stdout and "chat-passes/min" in proc.stdout
    logs = {log.name: log.read_text() for log in (tmp_path / "work").glob("*.log")}
    again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and {log.name: log.read_text() for log in (tmp_path / "work").glob("*.log")} == logs
    assert json.loads((tmp_path / "train_scaling.json").read_text())["runs"] == result["runs"]


def test_a_workdir_of_other_files_is_refused_and_left_alone(tmp_path: Path) -> None:
    """Unfinished runs are deleted before they start over: only in a folder this benchmark marked as its own."""
    from benchmarks.train_scaling import WORKDIR_MARK, claim_workdir

    theirs = tmp_path / "theirs"
    (theirs / "ddp-2").mkdir(parents=True)
    (theirs / "ddp-2" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="holds files this benchmark did not write"):
        claim_workdir(theirs)
    assert (theirs / "ddp-2" / "notes.txt").read_text() == "mine" and not (theirs / WORKDIR_MARK).exists()
    ours = tmp_path / "ours"
    claim_workdir(ours)
    (ours / "ddp-2").mkdir()
    claim_workdir(ours)  # an earlier run's folder: continued
    assert (ours / WORKDIR_MARK).exists()
