"""The target fingerprint names the model, not the dtype it is loaded in; a feature store extracted with
the target in another dtype is refused as such, with the setting that fixes it; older stores (whose hash
included the dtype) and older checkpoints stay usable."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch

from dflash_train.features.extract import ExtractConfig, extract
from dflash_train.features.store import FeatureStore
from dflash_train.target import (
    TargetModel,
    is_legacy_fingerprint,
    legacy_target_fingerprint,
    load_target,
    target_fingerprint,
    target_identity,
)
from dflash_train.training import resume as ckpt
from dflash_train.training.config import load_config
from dflash_train.training.trainer import run_training
from tests.helpers.training import save_tiny_prepared, save_tiny_target

LAYERS = [1, 3]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("fingerprint") / "target")


@pytest.fixture(scope="module")
def bf16(target_dir: Path) -> TargetModel:
    return load_target(str(target_dir), dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def fp32(target_dir: Path) -> TargetModel:
    return load_target(str(target_dir), dtype=torch.float32)


def rows(n: int = 4) -> datasets.Dataset:
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(7, 256, (12,), generator=g).tolist() for _ in range(n)]
    return datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": [[0] * 6 + [1] * 6] * n})


def store_of(target: TargetModel, out: Path, target_dtype: str, target_hash: str | None = None) -> FeatureStore:
    """A store as `dflash-train extract --target-dtype <target_dtype>` writes it (`target_hash`: override)."""
    settings = {"target": "tiny", "target_hash": target_hash or target_fingerprint(target.model),
                "target_dtype": target_dtype}
    extract(target, rows(), out, ExtractConfig(LAYERS, "bf16", rows_per_shard=2), settings, 0, 1)
    return FeatureStore(out)


def test_same_model_in_two_dtypes_has_one_fingerprint(bf16: TargetModel, fp32: TargetModel, tmp_path: Path) -> None:
    assert target_fingerprint(bf16.model) == target_fingerprint(fp32.model)
    other = save_tiny_target(tmp_path / "other", seed=1)
    assert target_fingerprint(load_target(str(other), dtype=torch.float32).model) != target_fingerprint(fp32.model)
    assert not is_legacy_fingerprint(target_fingerprint(fp32.model))


def test_store_in_another_dtype_is_refused_as_such(bf16: TargetModel, fp32: TargetModel, tmp_path: Path) -> None:
    store = store_of(bf16, tmp_path / "s", "bf16")
    store.check_compatible(LAYERS, 64, target_identity(bf16.model))
    with pytest.raises(ValueError, match=r"features were extracted with the target in bfloat16, this run loads it "
                                         r"in float32: set model\.target_dtype=bfloat16 \(or extract again with "
                                         r"--target-dtype fp32\)"):
        store.check_compatible(LAYERS, 64, target_identity(fp32.model))


def test_store_of_another_model_is_refused(fp32: TargetModel, target_dir: Path, tmp_path: Path) -> None:
    store = store_of(fp32, tmp_path / "s", "fp32")
    other = load_target(str(save_tiny_target(tmp_path / "other", seed=1)), dtype=torch.float32)
    with pytest.raises(ValueError, match="not the loaded target"):
        store.check_compatible(LAYERS, 64, target_identity(other.model))


def test_a_store_written_before_dtype_free_fingerprints(bf16: TargetModel, fp32: TargetModel, tmp_path: Path) -> None:
    store = store_of(bf16, tmp_path / "s", "bf16", target_hash=legacy_target_fingerprint(bf16.model))
    assert is_legacy_fingerprint(store.manifest["target_hash"])
    store.check_compatible(LAYERS, 64, target_identity(bf16.model))  # still readable
    with pytest.raises(ValueError, match=r"in bfloat16, this run loads it in float32: set model\.target_dtype"):
        store.check_compatible(LAYERS, 64, target_identity(fp32.model))
    other = load_target(str(save_tiny_target(tmp_path / "other", seed=1)), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not the loaded target"):
        store.check_compatible(LAYERS, 64, target_identity(other.model))


def test_checkpoints_compare_the_model_not_its_dtype(bf16: TargetModel, fp32: TargetModel) -> None:
    saved = {"target_fingerprint": target_fingerprint(bf16.model), "block_size": 4}
    ckpt.check_compatible(saved, {"target_fingerprint": target_fingerprint(fp32.model), "block_size": 4}, Path("c"))
    # Checkpoints of older versions recorded a dtype-dependent hash: not comparable, the other keys still are.
    legacy = {"target_fingerprint": legacy_target_fingerprint(bf16.model), "block_size": 4}
    ckpt.check_compatible(legacy, {"target_fingerprint": target_fingerprint(fp32.model), "block_size": 4}, Path("c"))
    with pytest.raises(ValueError, match="block_size: checkpoint has 4, this run has 8"):
        ckpt.check_compatible(legacy, {"target_fingerprint": target_fingerprint(fp32.model), "block_size": 8},
                              Path("c"))
    other = {"target_fingerprint": "v2-0123456789abcdef", "block_size": 4}
    with pytest.raises(ValueError, match="target_fingerprint: checkpoint has"):
        ckpt.check_compatible(other, {"target_fingerprint": target_fingerprint(fp32.model), "block_size": 4}, Path("c"))


def test_training_on_default_extract_features_with_a_float32_target(target_dir: Path, tmp_path: Path) -> None:
    """`extract` defaults to a bf16 target; a run loading it in float32 says which setting to change."""
    from dflash_train.cli import main as cli

    data = save_tiny_prepared(tmp_path / "data", num_rows=6)
    store = tmp_path / "features"
    assert cli(["extract", "--out", str(store), "--data", str(data), "--target", str(target_dir),
                "--layer-ids", "1,3", "--device", "cpu"]) == 0
    assert json.loads((store / "manifest.json").read_text())["target_dtype"] == "bf16"
    args = [f"model.target={target_dir}", "model.target_dtype=float32", "model.num_draft_layers=2",
            "model.block_size=4", "training.loss_decay_gamma=4", "model.target_layer_ids=[1, 3]", f"data.features={store}",
            "data.max_length=64",
            f"training.output_dir={tmp_path / 'run'}", "training.max_steps=1", "tracking.report_to=none",
            "training.mixed_precision=no"]  # as every trainer in this process: accelerate's state is set once
    with pytest.raises(ValueError, match=r"set model\.target_dtype=bfloat16"):
        run_training(load_config(None, args))
    assert not (tmp_path / "run" / "checkpoints").exists()
