"""CUDA-only: the trainer under DeepSpeed ZeRO-2 and under FSDP2 (through accelerate, one process) tracks
the plain bf16 run, and writes a whole drafter.

ZeRO-2 needs `deepspeed` (installed with the package on Linux); run with `make test-gpu`.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from dflash_train.checkpoint.io import load_draft
from dflash_train.training.config import load_config
from dflash_train.training.tracking import read_metrics
from dflash_train.training.trainer import run_training
from tests.helpers.paths import REPO
from tests.helpers.training import save_tiny_prepared, save_tiny_target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("launch_config", ["deepspeed_zero2.yaml", "fsdp2.yaml"])
def test_sharded_training_matches_plain_training(tmp_path: pathlib.Path, launch_config: str) -> None:
    if launch_config.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    target, data = save_tiny_target(tmp_path / "target"), save_tiny_prepared(tmp_path / "data", num_rows=40)
    common = [f"model.target={target}", "model.num_draft_layers=2", "model.block_size=4", f"data.prepared={data}",
              "data.max_length=64", "data.validation_fraction=0.1", "training.max_steps=20", "training.batch_size=2",
              "training.num_anchors=8", "training.loss_decay_gamma=4", "training.learning_rate=3e-3",
              "training.log_every=1", "training.eval_every=10", "training.save_every=10", "tracking.report_to=none",
              "training.attention=flex", "training.mixed_precision=bf16", "training.compile=true"]
    plain = tmp_path / "plain"
    run_training(load_config(None, [*common, f"training.output_dir={plain}"]))
    sharded = tmp_path / "sharded"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
         str(REPO / "recipes/accelerate" / launch_config), "--num_processes", "1",
         "-m", "dflash_train.train", "--config", str(REPO / "recipes/smollm2-135m-dflash-b16.yaml"),
         *common, f"training.output_dir={sharded}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    a, b = read_metrics(plain / "metrics.jsonl")["train"], read_metrics(sharded / "metrics.jsonl")["train"]
    assert len(a) == len(b) == 20
    # bf16 weights or bf16 compute under the sharding wrapper vs bf16 autocast: close, not identical
    for ra, rb in zip(a[:5], b[:5], strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=2e-2)
    assert b[-1]["loss"] < 0.9 * b[0]["loss"]
    last = "checkpoints/step-00000020/draft"
    whole, reference = load_draft(sharded / last).state_dict(), load_draft(plain / last).state_dict()
    assert whole.keys() == reference.keys()
    assert all(whole[name].shape == weight.shape for name, weight in reference.items())  # gathered, not shards
