"""The objective at temperature as configuration: `training.loss`, `training.loss_temperature` and
`training.distill_weight` from a YAML recipe and from the command line, the same config either way, mistakes as
one-line errors, and the trainer's objective and online features built from them."""

from __future__ import annotations

import pathlib
import re

import pytest
import yaml

from dflash_train.objective import Distillation
from dflash_train.training.config import TrainConfig, load_config
from dflash_train.training.trainer import run_training
from tests.helpers.training import overrides, train_losses

RECIPE = {"data": {"prepared": "data/prepared"},
          "training": {"loss": "tv", "loss_temperature": 0.7, "distill_weight": 0.5}}


def test_the_default_is_the_labels_cross_entropy() -> None:
    t = load_config(None, ["data.prepared=x"]).training
    assert (t.loss, t.loss_temperature, t.distill_weight, t.reads_target_distribution) == ("ce", 1.0, 1.0, False)


def test_a_recipe_and_overrides_give_the_same_config(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(RECIPE))
    from_yaml = load_config(path)
    from_cli = load_config(None, ["data.prepared=data/prepared", "training.loss=tv", "training.loss_temperature=0.7",
                                  "training.distill_weight=0.5"])
    assert from_yaml == from_cli and from_yaml.training.reads_target_distribution
    # What a run records (config.yaml beside its checkpoints) loads back to the same config.
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(from_yaml.to_dict()))
    assert load_config(again) == from_yaml


def test_integers_are_temperatures_and_a_weight_of_zero_reads_no_target_distribution() -> None:
    c = load_config(None, ["data.prepared=x", "training.loss=kl", "training.loss_temperature=1",
                           "training.distill_weight=0"])
    assert isinstance(c.training.loss_temperature, float) and not c.training.reads_target_distribution


@pytest.mark.parametrize(("extra", "message"), [
    (["training.loss=js"], "training.loss='js' is not one of ['ce', 'kl', 'tv']"),
    (["training.loss=kl", "training.loss_temperature=0"], "training.loss_temperature must be a finite number > 0, "
                                                          "got 0.0 (0 is greedy decoding, whose loss is training.loss=ce)"),
    (["training.loss=kl", "training.loss_temperature=-0.5"], "training.loss_temperature must be a finite number > 0"),
    (["training.loss=tv", "training.loss_temperature=.nan"], "training.loss_temperature must be a finite number > 0, "
                                                             "got nan"),
    (["training.loss=tv", "training.loss_temperature=.inf"], "got inf"),
    (["training.loss=tv", "training.loss_temperature=hot"], "training.loss_temperature='hot' must be of type float"),
    (["training.loss=kl", "training.distill_weight=1.5"], "training.distill_weight must be in [0, 1], got 1.5"),
    (["training.loss=kl", "training.distill_weight=.nan"], "training.distill_weight must be in [0, 1], got nan"),
    (["training.loss_temperature=0.7"], "training.loss_temperature applies to training.loss kl or tv only"),
    (["training.distill_weight=0.5"], "training.distill_weight applies to training.loss kl or tv only"),
    (["training.loss=kl", "training.soft_targets=true"], "training.soft_targets and training.loss=kl both set"),
])
def test_mistakes_are_one_line_errors(extra: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        load_config(None, ["data.prepared=x", *extra])
    assert "\n" not in str(error.value)


def test_a_distillation_needs_online_features() -> None:
    with pytest.raises(ValueError, match=re.escape("training.loss=tv needs the target's final states, computed "
                                                   "online: use data.prepared instead of data.features")):
        load_config(None, ["data.features=store", "training.loss=tv"])
    load_config(None, ["data.features=store", "training.loss=tv", "training.distill_weight=0"])  # the CE: offline is fine


def test_a_run_at_temperature_trains_online_and_learns(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import dflash_train.training.trainer as trainer_module

    built: list[tuple[bool, Distillation | None]] = []
    build_objective = trainer_module.Trainer._build_objective

    def recording(self: trainer_module.Trainer) -> object:
        objective = build_objective(self)
        built.append((self.features.soft_targets, objective.distillation))
        return objective

    monkeypatch.setattr(trainer_module.Trainer, "_build_objective", recording)
    out = tmp_path / "run"
    config: TrainConfig = load_config(None, overrides(assets, out, **{
        "training.max_steps": 12, "training.loss": "kl", "training.loss_temperature": 0.7,
        "training.distill_weight": 0.5}))
    run_training(config)
    assert built == [(True, Distillation("kl", 0.7, 0.5))]  # the target ran its whole body for its states
    losses = train_losses(out)
    assert sum(losses[s] for s in (10, 11, 12)) < sum(losses[s] for s in (1, 2, 3)), losses
