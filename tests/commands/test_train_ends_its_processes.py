"""The train command ends the process group of a distributed run once training is over, rather than leaving it
to the interpreter's exit (where NCCL warns that resources may leak)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from dflash_train.commands import train
from dflash_train.training.trainer import TrainResult


def test_the_process_group_is_destroyed_after_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                                         world_size=1)
    try:
        seen: list[bool] = []

        def fake_training(config: object) -> TrainResult:
            seen.append(torch.distributed.is_initialized())  # training itself still has its group
            return TrainResult(tmp_path, tmp_path / "step-00000001", 1, {}, 1)

        monkeypatch.setattr(train, "load_config", lambda path, overrides: object())
        monkeypatch.setattr(train, "claim_training_dir", lambda config, overwrite: None)
        monkeypatch.setattr(train, "run_training", fake_training)
        assert train.run(argparse.Namespace(config="recipe.yaml", overrides=[], overwrite=False)) == 0
        assert seen == [True] and not torch.distributed.is_initialized()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
