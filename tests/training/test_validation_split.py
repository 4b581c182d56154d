"""The train/validation split: validation asked for (data.validation_fraction > 0) is never dropped silently
because the dataset is small."""

from __future__ import annotations

import pytest

from dflash_train.training.data import split_indices


@pytest.mark.parametrize(("rows", "fraction", "most", "held_out"), [
    (10, 0.05, 16, 1),  # 0.5 rows by the fraction: one row is kept for validation anyway
    (2, 0.02, 256, 1),
    (100, 0.05, 16, 5),
    (1000, 0.05, 16, 16),  # capped by data.validation_max_samples
    (10, 0.0, 16, 0),  # no validation asked for
    (10, 0.05, 0, 0),  # validation_max_samples 0 turns it off too
    (1, 0.5, 16, 0),  # a single row is for training
])
def test_validation_rows(rows: int, fraction: float, most: int, held_out: int) -> None:
    train, validation = split_indices(rows, fraction, most, seed=0)
    assert len(validation) == held_out
    assert sorted(train + validation) == list(range(rows))


def test_the_small_hold_out_is_a_fixed_random_row() -> None:
    assert split_indices(10, 0.05, 16, seed=3) == split_indices(10, 0.05, 16, seed=3)
    assert {split_indices(10, 0.05, 16, seed=s)[1][0] for s in range(20)} != {0}  # not always the first row


def test_a_prompts_samples_and_turns_stay_on_one_side() -> None:
    keys = [f"sharegpt#{i // 3}" for i in range(300)]  # 100 prompts, three rows each (samples or turns)
    train, validation = split_indices(300, 0.05, 64, seed=0, keys=keys)
    assert 15 <= len(validation) <= 17 and sorted(train + validation) == list(range(300))
    held = {keys[i] for i in validation}
    assert not held & {keys[i] for i in train}  # no prompt on both sides
    assert all(sum(keys[i] == key for i in validation) == 3 for key in held)  # all three rows of each


def test_datasets_sharing_prompts_hold_out_the_same_shared_rows() -> None:
    """A second dataset with another source added: its shared prompts' hold-out is the first's, minus the
    rows the new source's prompts take from the capped count."""
    shared = [f"sharegpt#{i}" for i in range(2000)]
    first = {shared[i] for i in split_indices(2000, 0.02, 40, seed=1, keys=shared)[1]}
    mixed = shared[:1000] + [f"self-prompts#{i}" for i in range(500)] + shared[1000:]
    second = {mixed[i] for i in split_indices(2500, 0.02, 40, seed=1, keys=mixed)[1]}
    assert len(first) == len(second) == 40
    assert len(first & second) >= 25 and all(key.startswith("self-prompts") for key in second - first)
    assert split_indices(2000, 0.02, 40, seed=2, keys=shared)[1] != split_indices(2000, 0.02, 40, seed=1, keys=shared)[1]


def test_one_prompt_alone_is_split_by_row() -> None:
    train, validation = split_indices(4, 0.5, 16, seed=0, keys=["only#0"] * 4)
    assert len(validation) == 2 and len(train) == 2  # nothing would be left to train on by prompt
