"""Packed rows through the target: given per-chat position ids and no attention mask, Hugging Face keeps
each chat's attention inside the chat, so a packed chat's features are its features computed alone."""

from __future__ import annotations

import pytest
import torch

from dflash_train.features.capture import (
    capture_features,
    capture_features_and_final_states,
    compute_features,
    packed_features_and_final_states,
)
from dflash_train.features.packed_rows import collate_packed
from tests.helpers.tiny_models import TINY_ARCHS, make_tiny_target

LAYERS = [0, 2, 3]


def packed_rows(seed: int) -> tuple[list[list[torch.Tensor]], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    tokens = [[torch.randint(7, 256, (n,), generator=gen) for n in row] for row in ([9, 13, 5], [20], [6, 6])]
    rows = [[{"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)} for ids in row] for row in tokens]
    return tokens, collate_packed(rows, pack_tokens=30, num_rows=3)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_packed_chats_get_the_features_they_get_alone(arch: str) -> None:
    target = make_tiny_target(arch, num_layers=5)
    if arch == "mistral":
        target.model.config.sliding_window = 4  # shorter than the chats: windows must restart with each chat
    tokens, batch = packed_rows(0)
    packed = capture_features(target, batch["input_ids"], LAYERS, position_ids=batch["position_ids"])
    features, final = packed_features_and_final_states(target, batch["input_ids"], batch["position_ids"], LAYERS)
    torch.testing.assert_close(features, packed)
    unaware = capture_features(target, batch["input_ids"], LAYERS)  # one sequence per row: chats see each other
    for r, row in enumerate(tokens):
        start = 0
        for ids in row:
            span = slice(start, start + ids.shape[0])
            alone_features, alone_final = capture_features_and_final_states(target, ids[None], LAYERS)
            torch.testing.assert_close(packed[r, span], alone_features[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(final[r, span], alone_final[0], rtol=1e-5, atol=1e-5)
            if start > 0:
                assert not torch.allclose(unaware[r, span], alone_features[0], rtol=1e-3, atol=1e-3)
            start += ids.shape[0]


def test_compute_features_passes_the_position_ids() -> None:
    target = make_tiny_target("qwen3", num_layers=4)
    _, batch = packed_rows(1)
    expected = capture_features(target, batch["input_ids"], LAYERS, position_ids=batch["position_ids"])
    got = compute_features(target, batch["input_ids"], LAYERS, position_ids=batch["position_ids"])
    assert torch.equal(got, expected.to(torch.bfloat16))
