"""Validation with compiled drafter layers reuses the training graph: no second compilation for inference, and
the same metrics as an eager drafter validated in eval mode without gradients."""

from __future__ import annotations

import pathlib

import pytest

from dflash_train.training.config import load_config
from dflash_train.training.trainer import Trainer
from tests.helpers.training import overrides

PACKED = {"data.pack_tokens": 160, "data.max_length": 64, "training.max_steps": 2}


def test_validation_compiles_nothing_and_matches_the_eager_drafter(assets: dict[str, pathlib.Path],
                                                                    tmp_path: pathlib.Path) -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = Trainer(load_config(None, overrides(assets, tmp_path / "compiled", **{
        **PACKED, "training.compile": True})))
    compiled.train_step()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    with_compiled = compiled.validate()
    assert counters["stats"]["unique_graphs"] == graphs  # eval mode or no_grad would compile the layer again
    assert not torch.is_grad_enabled() or compiled.model.training  # back in training, gradients as before

    eager = Trainer(load_config(None, overrides(assets, tmp_path / "eager", **PACKED)))
    eager.model.load_state_dict(compiled.accelerator.unwrap_model(compiled.model).state_dict())
    reference = eager.validate()  # eval mode, no gradients
    assert with_compiled is not None and reference is not None
    assert with_compiled["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    assert with_compiled["slot_accuracy"] == reference["slot_accuracy"]
    assert with_compiled["expected_acceptance_length"] == pytest.approx(reference["expected_acceptance_length"])
