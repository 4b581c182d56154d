"""`fit` waits for the device only at the steps whose metrics it uses (logged, validated, saved, the last, and
each step of the time budget's probe); the others are queued without a sync. Against a run that waits at
every step: the same logged losses, and the waits only where they are due."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from dflash_train.training.config import load_config
from dflash_train.training.tracking import read_metrics
from dflash_train.training.trainer import Trainer, run_training
from tests.helpers.training import overrides, save_tiny_prepared, save_tiny_target, train_losses

STEPS = {"training.max_steps": 10, "training.log_every": 4, "training.eval_every": 0, "training.save_every": 6}


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("deferred_assets")
    return {"target": save_tiny_target(root / "target"), "data": save_tiny_prepared(root / "data", num_rows=24)}


def resolved_steps(monkeypatch: pytest.MonkeyPatch, always: bool) -> list[int]:
    """Record the steps whose metrics came to the host; `always`: every step's, as before."""
    seen: list[int] = []
    original = Trainer._reduce

    def reduce(self: Trainer, *args: Any, **kwargs: Any) -> dict[str, Any]:
        seen.append(self.step)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "_reduce", reduce)
    if always:
        monkeypatch.setattr(Trainer, "_resolve_due", lambda self, step: True)
    return seen


def test_only_the_steps_in_use_wait_and_the_logged_losses_do_not_change(
        assets: dict[str, pathlib.Path], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        every = resolved_steps(patch, always=True)
        run_training(load_config(None, overrides(assets, tmp_path / "every", **STEPS)))
    deferred = resolved_steps(monkeypatch, always=False)
    run_training(load_config(None, overrides(assets, tmp_path / "deferred", **STEPS)))
    assert every == list(range(1, 11))
    assert deferred == [1, 4, 6, 8, 10]  # the first (compilation timed), logged 4 and 8, saved 6, the last
    assert train_losses(tmp_path / "deferred") == train_losses(tmp_path / "every")
    assert sorted(train_losses(tmp_path / "deferred")) == [4, 8, 10]
    records = read_metrics(tmp_path / "deferred" / "metrics.jsonl")["train"]
    assert all(r["step_seconds"] > 0 for r in records)
    assert (tmp_path / "deferred" / "checkpoints" / "step-00000006").is_dir()


def test_the_time_budget_probe_waits_at_every_step(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Until the budget has sized the run from measured steps, each step is timed on its own."""
    trainer = Trainer(load_config(None, overrides(assets, tmp_path / "budget", **STEPS,
                                                  **{"training.time_budget_minutes": 5})))
    assert not trainer.budget.sized and trainer._resolve_due(3)
    trainer.budget.sized = True
    assert not trainer._resolve_due(3) and trainer._resolve_due(4)
