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
