"""The training-curves figure and the wandb keys, from metrics.jsonl records with and without sources."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from dflash_train.training.tracking import flatten, plot_metrics, read_metrics, source_curves


def record(step: int, split: str, tau: float, **extra: Any) -> dict[str, Any]:
    return {"step": step, "split": split, "loss": 3.0 / step, "mean_slot_accuracy": 0.1 * step,
            "slot_accuracy": [0.2, 0.1], "expected_acceptance_length": tau, **extra}


def write(path: pathlib.Path, records: list[dict[str, Any]]) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_metrics_file_without_sources_still_plots(tmp_path: pathlib.Path) -> None:
    """Files written before validation was broken down by source."""
    metrics = write(tmp_path / "metrics.jsonl", [record(1, "train", 1.1), record(2, "train", 1.2),
                                                 record(2, "validation", 1.3)])
    assert source_curves(read_metrics(metrics)["validation"]) == {}
    assert plot_metrics(metrics, tmp_path / "curves.png").stat().st_size > 10_000


def test_per_source_curves_follow_the_steps_that_have_them(tmp_path: pathlib.Path) -> None:
    sources = {"sharegpt": {"expected_acceptance_length": 1.6}, "math": {"expected_acceptance_length": 3.0}}
    metrics = write(tmp_path / "metrics.jsonl", [
        record(1, "train", 1.1), record(2, "validation", 1.3),  # a resumed run of an older version
        record(4, "validation", 1.9, by_source=sources), record(6, "validation", 2.0, by_source={
            "sharegpt": {"expected_acceptance_length": 1.7}})])
    curves = source_curves(read_metrics(metrics)["validation"])
    assert curves == {"sharegpt": ([4, 6], [1.6, 1.7]), "math": ([4], [3.0])}
    assert plot_metrics(metrics, tmp_path / "curves.png").stat().st_size > 10_000


def test_wandb_keys_give_each_source_its_own_charts() -> None:
    values = {"loss": 2.0, "slot_accuracy": [0.5, 0.25],
              "by_source": {"sharegpt": {"expected_acceptance_length": 1.6, "slot_accuracy": [0.4]}}}
    assert flatten("validation", values) == {
        "validation/loss": 2.0, "validation/slot_accuracy_1": 0.5, "validation/slot_accuracy_2": 0.25,
        "validation/sharegpt/expected_acceptance_length": 1.6, "validation/sharegpt/slot_accuracy_1": 0.4}
