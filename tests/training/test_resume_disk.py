"""A checkpoint the disk cannot hold: a one-line error that says what to do, and nothing saved is lost."""

from __future__ import annotations

import pathlib

import accelerate
import pytest

from dflash_train.training import resume as ckpt
from dflash_train.training.config import load_config
from dflash_train.training.trainer import run_training
from tests.helpers.training import overrides, train_losses


def step_dirs(out: pathlib.Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def test_a_full_disk_stops_before_writing_and_the_run_resumes(assets: dict[str, pathlib.Path],
                                                              tmp_path: pathlib.Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    run_training(load_config(None, overrides(assets, out, **{"training.max_steps": 3})))
    size = ckpt.directory_bytes(out / "checkpoints" / "step-00000003")
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: size // 2)
    with pytest.raises(ckpt.CheckpointSpaceError) as error:
        run_training(load_config(None, overrides(assets, out, **{"training.max_steps": 6})))
    message = str(error.value)
    assert "\n" not in message and message.startswith("disk full: checkpoint step-00000006 needs")
    assert "lower training.keep_last" in message and "step-00000003 is intact" in message
    assert step_dirs(out) == ["step-00000003"]  # no half-written step-6, the old one kept
    monkeypatch.undo()  # space freed: the same command resumes from step 3 and finishes
    result = run_training(load_config(None, overrides(assets, out, **{"training.max_steps": 6})))
    assert result.steps == 6 and step_dirs(out) == ["step-00000003", "step-00000006"]
    assert set(train_losses(out)) == set(range(1, 7))


def test_a_write_that_runs_out_of_space_is_reported_as_a_full_disk(assets: dict[str, pathlib.Path],
                                                                   tmp_path: pathlib.Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_save(self: accelerate.Accelerator, output_dir: str) -> None:
        pathlib.Path(output_dir).mkdir(parents=True)
        (pathlib.Path(output_dir) / "optimizer.bin").write_bytes(b"partial")
        free["bytes"] = free["after_write"]  # the disk filled up during the write (or not)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 3758291136 vs 3758291024")

    free = {"bytes": 2**40, "after_write": 0}
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: free["bytes"])
    monkeypatch.setattr(accelerate.Accelerator, "save_state", failing_save)
    out = tmp_path / "run"
    with pytest.raises(ckpt.CheckpointSpaceError, match="^disk full: checkpoint step-00000003 needs .*no checkpoint"):
        run_training(load_config(None, overrides(assets, out, **{"training.max_steps": 3})))
    assert step_dirs(out) == []  # the partial *.tmp is removed
    free["bytes"] = free["after_write"] = 2**40  # a failure that is not a full disk is not disguised as one
    with pytest.raises(RuntimeError, match="unexpected pos"):
        run_training(load_config(None, overrides(assets, out, **{"training.max_steps": 3})))
