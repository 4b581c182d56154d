"""A drafter trained by this project: its checkpoint exports, passes `check`, loads through
Transformers remote code, decodes losslessly, and imports back bit for bit."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from dflash_train.checkpoint import check_checkpoint, export_checkpoint, load_draft, save_draft
from dflash_train.target import load_target
from dflash_train.training.config import load_config
from dflash_train.training.trainer import run_training
from tests.helpers.checkpoints import load_remote, reference_greedy
from tests.helpers.training import save_tiny_prepared, save_tiny_target


def test_trained_checkpoint_exports_checks_and_decodes_losslessly(tmp_path: Path) -> None:
    target_dir, data = save_tiny_target(tmp_path / "target"), save_tiny_prepared(tmp_path / "data")
    run = tmp_path / "run"
    run_training(load_config(None, [
        f"model.target={target_dir}", "model.target_dtype=float32", "model.num_draft_layers=2",
        "model.block_size=4", f"data.prepared={data}", "data.max_length=64", "data.validation_fraction=0",
        f"training.output_dir={run}", "training.max_steps=30", "training.batch_size=2",
        "training.num_anchors=8", "training.loss_decay_gamma=4", "training.mixed_precision=no",
        "training.learning_rate=3e-3", "training.save_every=30", "tracking.report_to=none",
    ]))
    checkpoint = run / "checkpoints" / "step-00000030"
    exported = export_checkpoint(checkpoint, tmp_path / "export", target=str(target_dir))
    assert check_checkpoint(exported, load_target(str(target_dir), dtype=torch.float32).config) == []

    trained = load_draft(checkpoint / "draft")
    shipped = load_file(str(exported / "model.safetensors"))
    for name, tensor in trained.state_dict().items():
        assert torch.equal(shipped[name], tensor.to(torch.bfloat16)), name

    target = load_target(str(target_dir), dtype=torch.float32)
    ids = torch.tensor([[12, 40, 77, 10 + (50 % 240), 10 + (57 % 240), 10 + (64 % 240)]])
    remote = load_remote(exported)
    out = remote.spec_generate(target.model, ids, max_new_tokens=24, stop_token_ids=[], temperature=0.0)
    assert out[0, ids.shape[1] :].tolist() == reference_greedy(target, ids, 24)

    reexported = save_draft(load_draft(exported), tmp_path / "again")
    again = load_file(str(reexported / "model.safetensors"))
    assert set(again) == set(shipped) and all(torch.equal(again[k], shipped[k]) for k in shipped)
