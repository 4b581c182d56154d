"""Building the drafter from `init_from`: what the run's settings change in the loaded drafter."""

from __future__ import annotations

import pathlib

import pytest
import torch

from dflash_train.checkpoint.io import save_draft
from dflash_train.models import DFlashConfig, DFlashDraftModel
from dflash_train.target import load_target
from dflash_train.training.config import load_config
from dflash_train.training.setup import build_draft
from tests.helpers.training import overrides


@pytest.fixture(scope="module")
def saved_draft(assets: dict[str, pathlib.Path], tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A drafter of the tiny 6-layer target that reads two of its layers, saved."""
    target = load_target(str(assets["target"]), dtype=torch.float32)
    config = DFlashConfig.from_target_config(target.config, mask_token_id=5, num_hidden_layers=2, block_size=4)
    return save_draft(DFlashDraftModel(config), tmp_path_factory.mktemp("draft") / "draft", dtype=torch.float32)


def built(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path, **settings: object) -> DFlashDraftModel:
    config = load_config(None, overrides(assets, tmp_path, **settings))
    return build_draft(config, load_target(str(assets["target"]), dtype=torch.float32))


def test_init_from_keeps_the_drafters_mask_token_unless_one_is_set(
    assets: dict[str, pathlib.Path], saved_draft: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    base = {"model.init_from": str(saved_draft), "model.block_size": 4}
    assert built(assets, tmp_path / "a", **base).config.mask_token_id == 5
    assert built(assets, tmp_path / "b", **base, **{"model.mask_token_id": 7}).config.mask_token_id == 7


def test_init_from_refuses_a_mask_token_outside_the_target(
    assets: dict[str, pathlib.Path], saved_draft: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    target_rows = load_target(str(assets["target"]), dtype=torch.float32).vocab_size
    with pytest.raises(ValueError, match="mask"):
        built(assets, tmp_path, **{"model.init_from": str(saved_draft), "model.block_size": 4,
                                   "model.mask_token_id": target_rows + 3})


def test_freeze_refuses_a_prefix_that_matches_no_parameter(assets: dict[str, pathlib.Path],
                                                           tmp_path: pathlib.Path) -> None:
    """A typo froze nothing and the run trained every parameter, as if nothing had been asked."""
    with pytest.raises(ValueError) as error:
        built(assets, tmp_path / "a", **{"model.freeze": '["layers.", "nonexist."]', "model.block_size": 4})
    assert str(error.value) == "model.freeze: ['nonexist.'] match no parameter; use names like 'layers.' or 'fc.'"
    draft = built(assets, tmp_path / "b", **{"model.freeze": '["layers."]', "model.block_size": 4})
    frozen = {name for name, p in draft.named_parameters() if not p.requires_grad}
    assert frozen and all(name.startswith("layers.") for name in frozen)
    assert all(p.requires_grad for name, p in draft.named_parameters() if not name.startswith("layers."))


@pytest.mark.parametrize(("ids", "why"), [
    ("[2, 2]", r"target_layer_ids \[2, 2\] contains duplicates"),
    ("[3, 1]", r"target_layer_ids \[3, 1\] must be sorted"),
    ("[-1, 2]", r"Target layer id -1 is out of range for a 6-layer target"),
    ("[1, 5]", r"Target layer id 5 is the last layer of a 6-layer target"),
])
def test_init_from_refuses_bad_layer_ids_at_setup_in_one_line(
    assets: dict[str, pathlib.Path], saved_draft: pathlib.Path, tmp_path: pathlib.Path, ids: str, why: str
) -> None:
    """`model.target_layer_ids` were written into the loaded drafter's config in place, unchecked: repeated,
    unordered or negative ids passed setup and failed only at the first capture of the target. The config is
    now rebuilt by its own validated constructor."""
    with pytest.raises(ValueError, match=f"^model.init_from with model.target_layer_ids: {why}") as error:
        built(assets, tmp_path, **{"model.init_from": str(saved_draft), "model.block_size": 4,
                                   "model.target_layer_ids": ids})
    assert "\n" not in str(error.value)


def test_init_from_with_new_layer_ids_gets_a_new_config(
    assets: dict[str, pathlib.Path], saved_draft: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    draft = built(assets, tmp_path, **{"model.init_from": str(saved_draft), "model.block_size": 4,
                                       "model.target_layer_ids": "[0, 3]"})
    assert draft.config.target_layer_ids == [0, 3] and draft.config.num_target_layers == 6
