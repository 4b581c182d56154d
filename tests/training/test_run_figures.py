"""What a run records for its summary: every logged step's MFU (where the device's peak rate is known), and the
device in its checkpoints."""

from __future__ import annotations

import json
import pathlib

import pytest

from dflash_train.training.config import load_config
from dflash_train.training.flops import PEAK_TFLOPS_ENV
from dflash_train.training.tracking import read_metrics
from dflash_train.training.trainer import run_training
from tests.helpers.training import overrides


def test_each_logged_step_has_its_mfu_and_each_checkpoint_its_device(
        assets: dict[str, pathlib.Path], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PEAK_TFLOPS_ENV, "0.001")  # a peak rate for the CPU: 1 GFLOP/s
    result = run_training(load_config(None, overrides(assets, tmp_path / "run", **{"training.max_steps": 3})))
    train = read_metrics(tmp_path / "run" / "metrics.jsonl")["train"]
    assert train and all(r["mfu"] == pytest.approx(r["flops"] / r["step_seconds"] / 1e9) for r in train)
    state = json.loads((result.final_checkpoint / "trainer_state.json").read_text())
    assert state["device"] == "cpu"
