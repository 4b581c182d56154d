"""Validation per data source on a tiny target: each source's figures equal a validation of its chats alone,
they add up to the overall ones, packing does not change them, and one source logs nothing extra."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import datasets
import pytest
import torch

from dflash_train.training.config import load_config
from dflash_train.training.source_metrics import source_line, source_names
from dflash_train.training.tracking import read_metrics
from dflash_train.training.trainer import Trainer, run_training
from tests.helpers.training import overrides, save_tiny_prepared, save_tiny_target, train_on_two_cpu_processes

PACKED = {"data.pack_tokens": 160, "data.max_length": 64}
SPLIT = {"data.validation_fraction": 0.3}  # 12 of 40 chats: whole batches of 2, both sources


def with_sources(plain: pathlib.Path, out: pathlib.Path, names: list[str]) -> pathlib.Path:
    """`plain` prepared data with a `source` column: row i comes from names[i % len(names)]. Responses
    repeat one token but for every 2nd (first source) or 4th (second) one, left random: a drafter learns
    to hit some slots within a few steps, more of them on the second source."""
    dataset = datasets.load_from_disk(str(plain))
    dataset = dataset.add_column("source", [names[i % len(names)] for i in range(len(dataset))])

    def learnable(row: dict[str, Any]) -> dict[str, Any]:
        period = 2 + 2 * names.index(row["source"])
        row["input_ids"] = [t if m == 0 or i % period == 0 else 42
                            for i, (t, m) in enumerate(zip(row["input_ids"], row["loss_mask"], strict=True))]
        return row

    dataset.map(learnable).save_to_disk(str(out))
    (out / "dflash_data.json").write_text((plain / "dflash_data.json").read_text())
    return out


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("source_assets")
    plain = save_tiny_prepared(root / "plain", num_rows=40)
    return {"target": save_tiny_target(root / "target"), "plain": plain,
            "data": with_sources(plain, root / "two", ["sharegpt", "openai-evals:1000"]),
            "one": with_sources(plain, root / "one", ["sharegpt"])}


@pytest.fixture(scope="module")
def weights(assets: dict[str, pathlib.Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """A drafter trained a little: an untrained one hits no slot, which would leave the accuracies untested."""
    steps = {"training.max_steps": 40, "training.eval_every": 0, "training.save_every": 40,
             "training.learning_rate": 1e-2}
    run = trainer(assets, tmp_path_factory.mktemp("trained"), **steps)
    run.fit()
    return {k: v.clone() for k, v in run.model.state_dict().items()}


def trainer(assets: dict[str, pathlib.Path], out: pathlib.Path, weights: dict[str, torch.Tensor] | None = None,
            **extra: object) -> Trainer:
    run = Trainer(load_config(None, overrides(assets, out, **{**SPLIT, **extra})))
    if weights is not None:
        run.model.load_state_dict(weights)
    return run


def test_each_source_validates_like_its_chats_alone(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                                    weights: dict[str, torch.Tensor]) -> None:
    """Validation anchors are seeded per chat, so a source's chats validated on their own (the other
    source's removed from the split) see the same anchors: the same loss, accuracies and τ̂."""
    run = trainer(assets, tmp_path / "run", weights)
    both = run.validate()
    assert both is not None and sorted(both["by_source"]) == ["openai-evals:1000", "sharegpt"]
    taus = [m["expected_acceptance_length"] for m in both["by_source"].values()]
    assert min(taus) > 1.1 and taus[0] != taus[1]  # slots are hit, and differently per source
    everything = list(run.val_ids)
    for name, logged in both["by_source"].items():
        run.val_ids = [i for i in everything if run.val_sources[i] == name]
        alone = run.validate()
        assert alone is not None and "by_source" not in alone  # one source left: nothing extra
        assert logged["chats"] == len(run.val_ids)
        assert logged["supervised_slots"] == alone["supervised_slots"]
        assert logged["loss"] == pytest.approx(alone["loss"], rel=1e-5)
        assert logged["slot_accuracy"] == pytest.approx(alone["slot_accuracy"], abs=1e-5)
        assert logged["mean_slot_accuracy"] == pytest.approx(alone["mean_slot_accuracy"], abs=1e-5)
        assert logged["expected_acceptance_length"] == pytest.approx(alone["expected_acceptance_length"], abs=1e-5)


def test_the_sources_add_up_to_the_whole_split(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                               weights: dict[str, torch.Tensor]) -> None:
    """Chats, supervised slots and chat-weighted losses add up; τ̂ lies between the sources' (it pools their
    slot accuracies, weighted by their supervised slots, but is not linear in them)."""
    whole = trainer(assets, tmp_path / "run", weights).validate()
    assert whole is not None
    parts = whole["by_source"].values()
    assert sum(p["chats"] for p in parts) == 12
    assert sum(p["supervised_slots"] for p in parts) == whole["supervised_slots"]
    assert sum(p["loss"] * p["chats"] for p in parts) / 12 == pytest.approx(whole["loss"], rel=1e-6)
    taus = [p["expected_acceptance_length"] for p in parts]
    assert min(taus) - 1e-9 <= whole["expected_acceptance_length"] <= max(taus) + 1e-9


@pytest.mark.parametrize("variant", [{}, {"training.position_weighting": "dpace"}])
def test_packed_rows_give_the_same_figures_per_source(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                                      weights: dict[str, torch.Tensor],
                                                      variant: dict[str, object]) -> None:
    """A packed row mixes both sources: each chat's anchors still count for its own source."""
    unpacked = trainer(assets, tmp_path / "unpacked", weights, **variant).validate()
    packed_run = trainer(assets, tmp_path / "packed", weights, **PACKED, **variant)
    assert any(len({packed_run.val_sources[i] for i in row}) == 2 for group in packed_run.val_groups for row in group)
    packed = packed_run.validate()
    assert unpacked is not None and packed is not None
    assert sorted(packed["by_source"]) == sorted(unpacked["by_source"])
    for name, expected in unpacked["by_source"].items():
        got = packed["by_source"][name]
        assert got["chats"] == expected["chats"] and got["supervised_slots"] == expected["supervised_slots"]
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5), name
        assert got["slot_accuracy"] == pytest.approx(expected["slot_accuracy"], abs=1e-5), name
        assert got["expected_acceptance_length"] == pytest.approx(expected["expected_acceptance_length"], abs=1e-5)


@pytest.mark.parametrize("data", ["plain", "one"])
def test_one_source_or_none_logs_nothing_extra(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                               data: str) -> None:
    metrics = trainer({**assets, "data": assets[data]}, tmp_path / "run").validate()
    assert metrics is not None and "by_source" not in metrics


def test_a_run_logs_prints_and_plots_the_sources(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    run_training(load_config(None, overrides(assets, out, **{
        **SPLIT, "training.max_steps": 2, "training.eval_every": 2, "training.save_every": 2})))
    record = read_metrics(out / "metrics.jsonl")["validation"][-1]
    by_source: dict[str, Any] = record["by_source"]
    assert set(by_source["sharegpt"]) >= {"loss", "mean_slot_accuracy", "expected_acceptance_length",
                                          "supervised_slots"}
    assert source_line(by_source) in capsys.readouterr().out
    assert json.loads(json.dumps(by_source)) == by_source  # plain JSON: no NaN for these sources
    assert (out / "training_curves.png").stat().st_size > 10_000


def test_two_processes_sum_the_sources_like_one(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    """Each rank sums its own chats per source; the ranks' sums are reduced before the figures are taken."""
    single, double = tmp_path / "single", tmp_path / "double"
    short = {**SPLIT, **PACKED, "training.max_steps": 2, "training.eval_every": 2}
    run_training(load_config(None, overrides(assets, single, **short)))  # the same global batch: 2 rows
    train_on_two_cpu_processes(overrides(assets, double, **short, **{"training.batch_size": 1}), port_base=28100)
    one = read_metrics(single / "metrics.jsonl")["validation"][-1]["by_source"]
    two = read_metrics(double / "metrics.jsonl")["validation"][-1]["by_source"]
    assert sorted(one) == sorted(two)
    for name, expected in one.items():
        assert two[name]["chats"] == expected["chats"]
        assert two[name]["slot_accuracy"] == pytest.approx(expected["slot_accuracy"], abs=1e-5), name
        assert two[name]["loss"] == pytest.approx(expected["loss"], rel=1e-5), name


def test_source_line_and_names() -> None:
    by_source = {"a": {"expected_acceptance_length": 1.614, "loss": 2.5}, "b:1": {"expected_acceptance_length": 3.0,
                                                                               "loss": 1.25}}
    assert source_line(by_source) == "validation by source: a τ̂ 1.61 loss 2.500 · b:1 τ̂ 3.00 loss 1.250"
    assert source_names(["b", "a", "b"]) == ["a", "b"]
    assert source_names(["a", "a"]) == [] and source_names(None) == []
