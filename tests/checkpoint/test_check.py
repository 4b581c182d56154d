"""`check_checkpoint` catches every trap that the serving runtimes would swallow silently."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_train.checkpoint import check_checkpoint
from dflash_train.target import TargetModel
from tests.helpers.checkpoints import export_tiny
from tests.helpers.tiny_models import make_tiny_target

TENSORS = "model.safetensors"


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return make_tiny_target("qwen3", num_layers=6, seed=1)


@pytest.fixture
def export(tmp_path: Path, target: TargetModel) -> Path:
    return export_tiny(tmp_path, target, block_size=4)


def edit_config(directory: Path, change: Callable[[dict[str, Any]], None]) -> None:
    config = json.loads((directory / "config.json").read_text())
    change(config)
    (directory / "config.json").write_text(json.dumps(config))


def edit_tensors(directory: Path, change: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor] | None]) -> None:
    tensors = load_file(str(directory / TENSORS))
    tensors = change(tensors) or tensors
    save_file(tensors, str(directory / TENSORS), metadata={"format": "pt"})


def only_problem(directory: Path, target_config: Any = None) -> str:
    problems = check_checkpoint(directory, target_config)
    assert len(problems) == 1, problems
    assert "\n" not in problems[0]
    return problems[0]


def test_a_fresh_export_passes(export: Path, target: TargetModel) -> None:
    assert check_checkpoint(export) == []
    assert check_checkpoint(export, target.config) == []
    assert check_checkpoint(export, target.config.to_dict()) == []


def test_missing_tensor(export: Path) -> None:
    edit_tensors(export, lambda t: {k: v for k, v in t.items() if k != "layers.1.mlp.up_proj.weight"})
    problem = only_problem(export)
    assert "1 tensors missing" in problem and "layers.1.mlp.up_proj.weight" in problem


def test_model_prefixed_names(export: Path) -> None:
    edit_tensors(export, lambda t: {f"model.{k}": v for k, v in t.items()})
    problem = only_problem(export)
    assert "'model.' prefix" in problem and "25 tensors" in problem


def test_wrong_shape(export: Path) -> None:
    edit_tensors(export, lambda t: {**t, "fc.weight": t["fc.weight"][:, :64].contiguous()})
    assert only_problem(export) == "tensor fc.weight has shape [64, 64], config.json implies [64, 128]"


def test_embedding_or_head_shipped(export: Path) -> None:
    edit_tensors(export, lambda t: {**t, "lm_head.weight": torch.zeros(320, 64, dtype=torch.bfloat16)})
    assert "lm_head.weight" in only_problem(export)


@pytest.mark.parametrize("key", ["block_size", "num_target_layers", "dflash_config", "rope_theta"])
def test_missing_required_key(export: Path, key: str) -> None:
    edit_config(export, lambda c: c.pop(key))
    problems = check_checkpoint(export)
    assert key in problems[0] and "lacks" in problems[0]
    # without dflash_config the layer ids, hence the shape of fc, are unknown too
    assert problems[1:] == (["cannot derive tensor shapes from config.json (see the missing keys above)"]
                            if key == "dflash_config" else [])


@pytest.mark.parametrize("key", ["mask_token_id", "target_layer_ids", "block_size"])
def test_missing_dflash_config_entry(export: Path, key: str) -> None:
    edit_config(export, lambda c: c["dflash_config"].pop(key))
    problems = check_checkpoint(export)
    assert f"dflash_config lacks {key}" in problems
    # without the layer ids the tensor shapes cannot be derived either; nothing else is reported
    assert len(problems) == (2 if key == "target_layer_ids" else 1), problems


def test_mask_id_outside_vocabulary(export: Path, target: TargetModel) -> None:
    edit_config(export, lambda c: c["dflash_config"].update(mask_token_id=320))
    assert "mask_token_id 320 is outside the vocabulary [0, 320)" in only_problem(export)


def test_layer_id_beyond_the_configured_target(export: Path) -> None:
    edit_config(export, lambda c: c["dflash_config"].update(target_layer_ids=[1, 6]))
    assert "target_layer_ids [6] out of range for num_target_layers = 6 layers" in only_problem(export)


def test_layer_id_beyond_the_actual_target(export: Path, target: TargetModel) -> None:
    # The config claims a 12-layer target; the real one has 6.
    edit_config(export, lambda c: (c.update(num_target_layers=12), c["dflash_config"].update(target_layer_ids=[1, 9])))
    assert check_checkpoint(export) == []
    problems = check_checkpoint(export, target.config)
    assert problems == ["config.json num_target_layers 12 != the target's 6",
                        "target_layer_ids [9] out of range for the target = 6 layers: use ids in 0..4"]


def test_eagle_aux_key(export: Path) -> None:
    edit_config(export, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3]))
    assert "eagle_aux_hidden_state_layer_ids" in only_problem(export)


def test_mixed_dtypes(export: Path) -> None:
    edit_tensors(export, lambda t: {**t, "norm.weight": t["norm.weight"].float()})
    problem = only_problem(export)
    assert "mixed tensor dtypes" in problem and "norm.weight is F32" in problem


def test_float32_weights_disagree_with_the_contract_and_the_config(export: Path) -> None:
    edit_tensors(export, lambda t: {k: v.float() for k, v in t.items()})
    problems = check_checkpoint(export)
    assert any("the export contract is bfloat16" in p for p in problems)
    assert any("torch_dtype 'bfloat16' disagrees" in p for p in problems)


def test_block_size_disagreement(export: Path) -> None:
    edit_config(export, lambda c: c["dflash_config"].update(block_size=8))
    assert "dflash_config.block_size 8 != top-level block_size 4" in only_problem(export)


def test_missing_files_and_tokenizer_files(export: Path) -> None:
    (export / "dflash.py").unlink()
    assert "missing dflash.py" in only_problem(export)
    (export / "dflash.py").write_text("")
    (export / "tokenizer.json").write_text("{}")
    assert "tokenizer files" in only_problem(export)
    (export / "tokenizer.json").unlink()
    (export / TENSORS).unlink()
    assert "missing model.safetensors" in only_problem(export)


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("hidden_size", 128, "hidden_size 64 != the target's 128"),
    ("vocab_size", 400, "vocab_size 320 != the target's 400"),
    ("max_position_embeddings", 4096, "max_position_embeddings 256 < the target's 4096"),
])
def test_target_disagreement(export: Path, target: TargetModel, key: str, value: int, expected: str) -> None:
    target_config = {**target.config.to_dict(), key: value}
    assert expected in only_problem(export, target_config)


def test_not_a_directory(tmp_path: Path) -> None:
    assert check_checkpoint(tmp_path / "nothing") == [f"{tmp_path / 'nothing'} is not a directory"]


def test_either_dtype_key_is_enough(export: Path) -> None:
    edit_config(export, lambda c: c.pop("torch_dtype"))
    assert check_checkpoint(export) == []
    edit_config(export, lambda c: c.pop("dtype"))
    assert "lacks torch_dtype" in only_problem(export)
