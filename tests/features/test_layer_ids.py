from __future__ import annotations

import pytest

from dflash_train.features.layer_ids import (
    default_target_layer_ids,
    validate_drafter_layer_ids,
    validate_target_layer_ids,
)
from tests.helpers.tiny_drafts import tiny_config


@pytest.mark.parametrize(
    ("num_target_layers", "num_draft_layers", "expected"),
    [
        (36, 5, [1, 9, 17, 25, 33]),  # Qwen3-8B / 4B
        (32, 5, [1, 8, 15, 22, 29]),  # Llama-3.1-8B
        # Ties at 7.5 and 20.5 round half to even, as in the reference drafters.
        (30, 5, [1, 8, 14, 20, 27]),
        (28, 5, [1, 7, 13, 19, 25]),
        (36, 2, [1, 33]),
        (5, 2, [1, 2]),
    ],
)
def test_default_ids_match_published_layouts(
    num_target_layers: int, num_draft_layers: int, expected: list[int]
) -> None:
    assert default_target_layer_ids(num_target_layers, num_draft_layers) == expected


@pytest.mark.parametrize(("num_target_layers", "expected"), [(36, [18]), (4, [2]), (3, [1]), (7, [3])])
def test_single_draft_layer_takes_the_middle(num_target_layers: int, expected: list[int]) -> None:
    assert default_target_layer_ids(num_target_layers, 1) == expected


def test_default_ids_are_valid_and_leave_the_last_layer_out() -> None:
    for num_target_layers in range(4, 65):
        for num_draft_layers in range(1, 9):
            if num_draft_layers > 1 and num_draft_layers > num_target_layers - 3:
                with pytest.raises(ValueError, match="Cannot spread"):
                    default_target_layer_ids(num_target_layers, num_draft_layers)
                continue
            ids = default_target_layer_ids(num_target_layers, num_draft_layers)
            assert len(ids) == num_draft_layers
            assert ids == sorted(set(ids))
            assert ids[0] >= 1 and ids[-1] <= num_target_layers - 2
            if num_draft_layers > 1:
                assert (ids[0], ids[-1]) == (1, num_target_layers - 3)


def test_small_targets() -> None:
    assert default_target_layer_ids(4, 1) == [2]
    with pytest.raises(ValueError, match="at most 1 draft layers"):
        default_target_layer_ids(4, 2)
    with pytest.raises(ValueError, match="at least 3 decoder layers"):
        default_target_layer_ids(2, 1)
    with pytest.raises(ValueError, match="at least 1"):
        default_target_layer_ids(36, 0)


def test_validate_accepts_sorted_in_range_ids() -> None:
    assert validate_target_layer_ids((0, 3, 5), 6) == [0, 3, 5]


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([], "empty"),
        ([1, 6], "out of range"),
        ([-1, 2], "out of range"),
        ([1, 1, 2], "duplicates"),
        ([3, 1], "sorted"),
        ([1.0, 2], "integers"),
        ([True], "integers"),
    ],
)
def test_validate_rejects_bad_ids(ids: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_target_layer_ids(ids, 6)


def test_drafter_layer_ids_refuse_the_last_layer() -> None:
    """Id k is hidden_states[k + 1] in Hugging Face, post-norm for the last layer: serving would differ."""
    assert validate_drafter_layer_ids([0, 4], 6) == [0, 4]
    assert validate_target_layer_ids([0, 5], 6) == [0, 5]  # capture itself may read any layer
    with pytest.raises(ValueError, match=r"last layer of a 6-layer target.*ids in 0\.\.4"):
        validate_drafter_layer_ids([0, 5], 6)


def test_drafter_config_refuses_the_last_layer() -> None:
    with pytest.raises(ValueError, match="last layer"):
        tiny_config(num_target_layers=6, num_hidden_layers=2, target_layer_ids=[1, 5])
