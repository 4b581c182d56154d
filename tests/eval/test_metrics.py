"""Acceptance statistics against hand-computed values, and drafter/target compatibility errors."""

from __future__ import annotations

import pytest

from dflash_train.eval.compat import check_compatible
from dflash_train.eval.metrics import acceptance_metrics, running_tau
from dflash_train.models import DFlashConfig, DFlashDraftModel
from dflash_train.target import resolve_mask_token_id
from tests.helpers.tiny_models import make_tiny_target


def test_acceptance_metrics_by_hand() -> None:
    # Request 1: cycles 4, 1 (mean 2.5); request 2: cycle 2 (mean 2); request 3: no cycle (excluded).
    metrics = acceptance_metrics([[4, 1], [2], []], block_size=4)
    assert metrics["acceptance_length"] == pytest.approx((2.5 + 2) / 2)
    assert metrics["acceptance_length_cycle_weighted"] == pytest.approx(7 / 3)
    assert metrics["histogram"] == [1, 1, 0, 1]
    # slot k accepted in a cycle iff a+1 > k: slot 1 in {4, 2}, slot 2 in {4}, slot 3 in {4}
    assert metrics["per_slot_acceptance"] == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    assert metrics["per_slot_conditional_acceptance"] == pytest.approx([2 / 3, 1 / 2, 1.0])
    assert metrics["requests_with_cycles"] == 2 and metrics["cycles"] == 3
    assert running_tau([[4, 1], [2]]) == pytest.approx(2.25)
    # Two request means, 2.5 and 2: every resample's mean is 2, 2.25 or 2.5, so the interval spans them.
    assert metrics["acceptance_length_ci95"] == pytest.approx((2.0, 2.5))


def test_acceptance_metrics_without_cycles_and_out_of_range() -> None:
    metrics = acceptance_metrics([[], []], block_size=2)
    assert metrics["acceptance_length"] is None and metrics["histogram"] == [0, 0]
    assert metrics["acceptance_length_ci95"] is None
    with pytest.raises(AssertionError):
        acceptance_metrics([[3]], block_size=2)


def make_draft(**overrides: object) -> DFlashDraftModel:
    target = make_tiny_target("qwen3", num_layers=6)
    mask_id = resolve_mask_token_id(target.tokenizer, target.vocab_size)
    config = DFlashConfig.from_target_config(target.config, mask_token_id=mask_id, num_hidden_layers=2)
    for key, value in overrides.items():
        setattr(config, key, value)
    return DFlashDraftModel(config)


@pytest.mark.parametrize(("override", "message"), [
    ({"hidden_size": 32}, "hidden size 32 != target hidden size 64"),
    ({"vocab_size": 300}, "vocabulary 300 != target embedding rows 320"),
    ({"target_layer_ids": [1, 6]}, r"Target layer id 6 is out of range for a 6-layer target.*\(the drafter's target_layer_ids\)"),
    ({"target_layer_ids": [1, 5]}, r"Target layer id 5 is the last layer of a 6-layer target.*use ids in 0\.\.4 \(the drafter's"),
    ({"mask_token_id": 320}, "mask token 320 is outside the target's 320 embedding rows"),
])
def test_mismatched_drafter_is_a_one_line_error(override: dict[str, object], message: str) -> None:
    target = make_tiny_target("qwen3", num_layers=6)
    draft = make_draft()
    for key, value in override.items():
        setattr(draft.config, key, value)
    with pytest.raises(ValueError, match=message) as error:
        check_compatible(draft, target, block_size=4)
    assert "\n" not in str(error.value)


def test_compatible_drafter_passes() -> None:
    check_compatible(make_draft(), make_tiny_target("qwen3", num_layers=6), block_size=16)
