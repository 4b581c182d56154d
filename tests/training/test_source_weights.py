"""`data.source_weights`: each epoch draws a source's chats as many times as its weight says (counted against the
sources themselves), the fractional share is chosen anew each epoch, weights of 1 change nothing, and the trainer
draws its steps, packed or not, from the weighted chats; wrong weights and names are refused in one line."""

from __future__ import annotations

import pathlib
from collections import Counter

import datasets
import pytest

from dflash_train.training.config import load_config
from dflash_train.training.data import StepPlan, chat_weights, draws_per_epoch, epoch_order, weighted_draws
from dflash_train.training.trainer import Trainer, anchor_seed, anchor_seeds
from tests.helpers.training import overrides, save_tiny_prepared, save_tiny_target

SOURCES = ["code"] * 40 + ["chat"] * 40 + ["math"] * 20  # chat i comes from SOURCES[i]
WEIGHTS = {"code": 2.0, "chat": 0.5, "math": 0.0}


def per_chat(source_weights: dict[str, float]) -> list[float]:
    return [source_weights.get(source, 1.0) for source in SOURCES]


def test_each_source_is_drawn_as_often_as_its_weight() -> None:
    train = list(range(100, 200))  # sample indices, not positions
    for epoch in range(4):
        drawn = Counter(weighted_draws(train, per_chat(WEIGHTS), seed=3, epoch=epoch))
        by_source = {name: [drawn[train[i]] for i, s in enumerate(SOURCES) if s == name] for name in WEIGHTS}
        assert by_source["code"] == [2] * 40
        assert sorted(by_source["chat"]) == [0] * 20 + [1] * 20
        assert by_source["math"] == [0] * 20
        assert sum(drawn.values()) == draws_per_epoch(train, per_chat(WEIGHTS)) == 100
        order = epoch_order(train, 3, epoch, per_chat(WEIGHTS))
        assert Counter(order) == drawn  # shuffled, nothing lost or added


def test_the_fractional_share_is_chosen_again_each_epoch() -> None:
    train = list(range(100))
    chosen = [frozenset(c for c in weighted_draws(train, per_chat(WEIGHTS), 3, epoch) if SOURCES[c] == "chat")
              for epoch in range(6)]
    assert len(set(chosen)) == 6  # six different halves
    assert len(frozenset().union(*chosen)) > 30  # most of the source is seen within six epochs, not one half
    again = frozenset(c for c in weighted_draws(train, per_chat(WEIGHTS), 3, 2) if SOURCES[c] == "chat")
    assert again == chosen[2]  # a pure function of (seed, epoch): a resumed run draws the same


def test_weights_of_one_change_nothing() -> None:
    train = [7, 3, 11, 5, 2, 19, 13]
    for epoch in range(3):
        assert epoch_order(train, 5, epoch, [1.0] * len(train)) == epoch_order(train, 5, epoch)
    assert draws_per_epoch(train, None) == draws_per_epoch(train, [1.0] * 7) == 7


def test_wrong_names_and_data_are_refused() -> None:
    with pytest.raises(ValueError, match="names cod, which no training chat comes from .*chat, code, math"):
        chat_weights({"cod": 2.0}, SOURCES)
    with pytest.raises(ValueError, match="keeps none: prepare it again"):
        chat_weights({"code": 2.0}, None)
    with pytest.raises(ValueError, match="no training chat to draw"):
        chat_weights({"code": 0, "chat": 0, "math": 0}, SOURCES)


def test_the_config_takes_weights_per_source(tmp_path: pathlib.Path) -> None:
    base = [f"data.prepared={tmp_path}"]
    config = load_config(None, [*base, "data.source_weights.code-prompts=2",
                                "data.source_weights.reasoning-gym-math:steps=1.5"])
    assert config.data.source_weights == {"code-prompts": 2.0, "reasoning-gym-math:steps": 1.5}
    assert load_config(None, [*base, "data.source_weights={sharegpt: 0}"]).data.source_weights == {"sharegpt": 0.0}
    for bad, said in (("-1", "must be a number >= 0"), (".nan", "must be a number >= 0"),
                      ("many", "must be of type float")):
        with pytest.raises(ValueError, match=said):
            load_config(None, [*base, f"data.source_weights.sharegpt={bad}"])


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("weights")
    plain = save_tiny_prepared(root / "plain", num_rows=30)
    dataset = datasets.load_from_disk(str(plain))
    dataset.add_column("source", ["code", "chat", "math"] * 10).save_to_disk(str(root / "data"))
    (root / "data" / "dflash_data.json").write_text((plain / "dflash_data.json").read_text())
    return {"target": save_tiny_target(root / "target"), "data": root / "data"}


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_trainer_draws_its_steps_from_the_weighted_chats(assets: dict[str, pathlib.Path],
                                                             tmp_path: pathlib.Path, packed: bool) -> None:
    layout = {"data.pack_tokens": 160} if packed else {}
    run = Trainer(load_config(None, overrides(assets, tmp_path, **layout, **{
        "data.source_weights.code": 2, "data.source_weights.math": 0, "training.batch_size": 1})))
    sources = dict(zip(run.train_ids, run.samples.sources(run.train_ids) or [], strict=True))
    if packed:
        assert run.packed is not None
        drawn = Counter(chat for row in run.packed.epoch_rows(0) for chat in row)
        steps = range(run.packed.steps_in_epoch(0))
        trained = Counter(c for s in steps for rows in run.packed.micro_batches(s, 0) for row in rows for c in row)
        assert set(trained) <= set(drawn) and sum(trained.values()) > len(sources) // 2
    else:
        steps = range(draws_per_epoch(run.train_ids, run.train_weights))  # batch 1: a chat a step
        drawn = Counter(c for s in steps for group in run.plan.micro_batches(
            run.train_ids, 0, s, 0, run.train_weights) for c in group)
    assert {sources[c] for c in drawn} == {"code", "chat"}
    assert all(drawn[c] == (2 if sources[c] == "code" else 1) for c in drawn)
    assert len(drawn) == sum(1 for s in sources.values() if s != "math")


def test_an_unknown_source_is_said_before_the_target_loads(assets: dict[str, pathlib.Path],
                                                           tmp_path: pathlib.Path) -> None:
    broken = dict(assets, target=tmp_path / "no-such-target")  # loading it would fail with another message
    with pytest.raises(ValueError, match="names sharegpt, which no training chat comes from"):
        Trainer(load_config(None, overrides(broken, tmp_path, **{"data.source_weights.sharegpt": 2})))


def test_copies_of_a_chat_in_one_step_get_anchors_of_their_own() -> None:
    """A chat drawn twice into one step would otherwise train the same anchors twice; a step without copies
    keeps the seeds it always had."""
    seeds = anchor_seeds(0, 5, [7, 3, 7, 7])
    assert len(set(seeds)) == 4
    assert seeds[:2] == [anchor_seed(0, 5, 7), anchor_seed(0, 5, 3)]
    assert anchor_seeds(1, 2, [4, 9]) == [anchor_seed(1, 2, 4), anchor_seed(1, 2, 9)]


def test_the_step_plan_reads_each_epochs_order_as_built_afresh() -> None:
    """The plan keeps the last epoch's order: across epoch boundaries, and for another chat list given to the same
    plan, each step's chats are still the slice of the order `epoch_order` builds for that epoch."""
    plan = StepPlan(batch_size=3, num_processes=1, accumulation=1)
    for train, weights in ((list(range(100)), per_chat(WEIGHTS)), (list(range(50, 60)), None)):
        draws = draws_per_epoch(train, weights)
        for step in range(2 * (draws // 3) + 2):
            epoch, within = divmod(step, draws // 3)
            expected = epoch_order(train, 3, epoch, weights)[within * 3 : within * 3 + 3]
            assert next(plan.micro_batches(train, 3, step, 0, weights)) == expected
