"""`rows_not_packed`: captures skip Hugging Face's per-forward packing check (a host sync) and give the
same features; a caller's own position ids (perhaps packed) keep the check."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import transformers.masking_utils as masking_utils

from dflash_train.features.capture import capture_features, capture_features_and_final_states, rows_not_packed
from dflash_train.target import TargetModel
from tests.helpers.features import LAYER_IDS, reference_features
from tests.helpers.tiny_models import tiny_batch


@pytest.fixture
def check_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts calls of Hugging Face's packing check (the real one still answers)."""
    calls: list[int] = []
    original = masking_utils.find_packed_sequence_indices

    def spy(position_ids: torch.Tensor) -> torch.Tensor | None:
        calls.append(1)
        return original(position_ids)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", spy)
    yield calls


def test_capture_skips_the_check_and_gives_the_same_features(tiny: TargetModel, check_calls: list[int]) -> None:
    input_ids = tiny_batch(batch=3, seq_len=10, seed=2)
    expected = reference_features(tiny, input_ids, LAYER_IDS)  # a plain Hugging Face forward: checks
    assert check_calls, "the plain forward must run the packing check, or this test proves nothing"
    check_calls.clear()
    features = capture_features(tiny, input_ids, LAYER_IDS)
    final_features, _ = capture_features_and_final_states(tiny, input_ids, LAYER_IDS)
    assert check_calls == []
    torch.testing.assert_close(features, expected, rtol=0, atol=0)
    torch.testing.assert_close(final_features, expected, rtol=0, atol=0)


def test_given_position_ids_keep_the_check(tiny: TargetModel, check_calls: list[int]) -> None:
    """Two sequences of 5 packed into each row: the check must see them and mask across the boundary."""
    input_ids = tiny_batch(batch=2, seq_len=10, seed=3)
    position_ids = torch.arange(5).repeat(2).expand(2, -1)
    features = capture_features(tiny, input_ids, LAYER_IDS, position_ids=position_ids)
    assert check_calls
    second_alone = capture_features(tiny, input_ids[:, 5:], LAYER_IDS)
    torch.testing.assert_close(features[:, 5:], second_alone, rtol=1e-5, atol=1e-5)


def test_nested_contexts_restore_the_check_on_the_outermost_exit() -> None:
    original = masking_utils.find_packed_sequence_indices
    with rows_not_packed():
        with rows_not_packed():
            assert masking_utils.find_packed_sequence_indices(torch.tensor([[0, 1, 0, 1]])) is None
        assert masking_utils.find_packed_sequence_indices is not original
    assert masking_utils.find_packed_sequence_indices is original
    assert original(torch.tensor([[0, 1, 0, 1]])) is not None  # the real check does see packing
