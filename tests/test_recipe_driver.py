"""`recipes/smollm2-135m-h200.sh all` end to end at toy sizes on the real SmolLM2 (CPU): regenerate, prepare,
the main run and the three ablations side by side, a DEADLINE stop and resume, every eval, export, check, and
the summary table."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tests.test_target import needs_smollm2

REPO = pathlib.Path(__file__).resolve().parent.parent
TOY = {"MAX_NEW_TOKENS": "48", "MAX_LENGTH": "256", "TRAIN_MINUTES": "0.5", "ABLATION_STEPS": "3",
       "EVAL_PROMPTS": "1", "ABLATION_EVAL_PROMPTS": "1", "TRACKING": "none", "BATCH_SIZE": "1", "NUM_ANCHORS": "8",
       "PROMPTS": f"--data {REPO / 'data/prompts/demo_prompts.jsonl'} --max-samples 8",
       "TRAIN_EXTRA": "training.compile=false training.mixed_precision=no data.validation_fraction=0.25 "
                      "model.target_dtype=float32"}


def driver(stage: str, out: pathlib.Path, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **TOY, "OUT": str(out), "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", **extra,
           "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    # Own process group: a stage that overruns is stopped with every job it started, not just bash.
    proc = subprocess.Popen(["bash", str(REPO / "recipes/smollm2-135m-h200.sh"), stage], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=1800)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.slow
@needs_smollm2
def test_recipe_driver_runs_every_stage_and_resumes(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "run"
    data = driver("data", out)
    assert data.returncode == 0, data.stderr[-3000:]
    stopped = driver("train", out, DEADLINE=str(int(time.time()) + 31))  # stop_after 0.1 min: a stop, then resume
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "stopped at step" in (out / "train" / "main.log").read_text()
    finished = driver("train", out)
    log = (out / "train" / "main.log").read_text()
    assert finished.returncode == 0, log[-3000:]
    assert "stopped at step" in log and "resumed from" in log  # the log of a resumed run keeps both parts
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(json.dumps({"prompt": "Name three primary colours."}) + "\n")
    evaluated = driver("eval", out, HELDOUT=str(heldout))
    assert evaluated.returncode == 0, (evaluated.stdout + evaluated.stderr)[-3000:]
    rows = json.loads((out / "summary.json").read_text())
    runs = {(row["run"], row["block"], row["dtype"]) for row in rows}
    assert {("main", 16, "float32"), ("main", 8, "float32"), ("ablation-random-anchors", 16, "float32"),
            ("ablation-partition-anchors", 16, "float32"), ("ablation-no-decay", 16, "float32")} <= runs
    assert ("main", "heldout") in {(row["run"], row["dataset"]) for row in rows}
    assert all(row["lossless"] == "yes" for row in rows)
    assert all(row["steps"] for row in rows)
    assert (out / "export" / "config.json").is_file()


@pytest.mark.slow
@needs_smollm2
def test_recipe_driver_on_two_processes(tmp_path: pathlib.Path) -> None:
    """GPUS=2: the main run under `accelerate launch` with two processes (CPU processes here, through
    LAUNCH_CONFIG), then the evaluations split in two groups running side by side."""
    out = tmp_path / "run"
    two = {"GPUS": "2", "LAUNCH_CONFIG": "recipes/accelerate/cpu_2proc.yaml", "ABLATIONS": "0"}
    assert driver("data", out, **two).returncode == 0
    trained = driver("train", out, **two)
    log = (out / "train" / "main.log").read_text()
    assert trained.returncode == 0, log[-3000:]
    state = json.loads(next((out / "train" / "main" / "checkpoints").glob("step-*/trainer_state.json")).read_text())
    assert state["sequences_seen"] == 2 * state["step"]  # BATCH_SIZE=1 on each of two processes
    evaluated = driver("eval", out, **two, HELDOUT=str(tmp_path / "none.jsonl"))
    assert evaluated.returncode == 0, (evaluated.stdout + evaluated.stderr)[-3000:]
    runs = {(row["run"], row["block"], row["dtype"]) for row in json.loads((out / "summary.json").read_text())}
    assert runs == {("main", 16, "float32"), ("main", 8, "float32")}  # fp32 run: the toy trains in float32
    assert (out / "export" / "config.json").is_file()
