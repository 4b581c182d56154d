"""FSDP2 through `accelerate launch` on two CPU processes (gloo): the same losses as one plain process with
the same global batch, a stop and resume from the sharded checkpoint that changes nothing (on two processes,
and on one plain process), and a final drafter equal to the plain run's."""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

import pytest
import torch

from dflash_train.checkpoint.io import load_draft
from dflash_train.training.config import load_config
from dflash_train.training.trainer import run_training
from tests.test_training import REPO, assets, launch, overrides, train_losses  # noqa: F401  (assets: fixture)


def test_fsdp2_two_processes_stop_resume_and_match_one(assets: dict[str, pathlib.Path],  # noqa: F811
                                                       tmp_path: pathlib.Path) -> None:
    steps = 6
    single, sharded = tmp_path / "single", tmp_path / "fsdp2"
    run_training(load_config(None, overrides(assets, single, **{"training.max_steps": steps})))
    args = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(REPO / "recipes/accelerate/cpu_fsdp2.yaml"), "--main_process_port", str(29000 + os.getpid() % 500),
            "-m", "dflash_train.train", "--config", str(REPO / "recipes/smollm2-135m-dflash-b16-cpu.yaml"),
            *overrides(assets, sharded, **{"training.max_steps": steps, "training.batch_size": 1})]
    first = launch([*args, "training.stop_after_minutes=1e-9"]).communicate(timeout=300)[0].decode()
    assert "stopped at step 1 of 6" in first, first[-3000:]
    on_one = tmp_path / "fsdp2-then-one"  # the sharded run's checkpoint, resumed by one plain process
    shutil.copytree(sharded / "checkpoints", on_one / "checkpoints")
    run_training(load_config(None, overrides(assets, on_one, **{"training.max_steps": steps})))
    resumed = launch(args)
    output = resumed.communicate(timeout=300)[0].decode()
    assert resumed.returncode == 0 and "resumed from" in output, output[-3000:]
    expected, got = train_losses(single), train_losses(sharded)
    assert sorted(got) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step
    continued = train_losses(on_one)
    assert sorted(continued) == list(range(2, steps + 1))
    for step in continued:
        assert continued[step] == pytest.approx(expected[step], rel=1e-5), step
    last = f"checkpoints/step-{steps:08d}/draft"
    plain, fsdp = load_draft(single / last).state_dict(), load_draft(sharded / last).state_dict()
    assert plain.keys() == fsdp.keys()
    for name, weight in plain.items():  # saved in bf16: a reduction-order difference may flip one rounding step
        torch.testing.assert_close(fsdp[name].float(), weight.float(), rtol=2**-7, atol=1e-6, msg=name)
