"""Packed training computes what unpacked training computes: the same chats with the same anchors give the
same loss, metrics and gradients whether each chat has its own row or several share one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash_train.features.packed_rows import chat_layout, collate_packed
from dflash_train.objective import DFlashObjective
from dflash_train.objective.masks import packed_dense_mask
from dflash_train.target import TargetModel
from dflash_train.training.data import collate
from tests.helpers.packing import LAYERS, PACK, chats, drafter, run
from tests.helpers.tiny_models import make_tiny_target


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return make_tiny_target("qwen3", num_layers=5)


@pytest.mark.parametrize("source,partition", [("online", False), ("offline", False), ("soft", False),
                                              ("online", True)])
def test_a_packed_batch_equals_its_chats_unpacked(target: TargetModel, source: str, partition: bool) -> None:
    draft = drafter(target)
    rows = chats(0, len(LAYERS) * target.hidden_size)
    flat = [chat for row in rows for chat in row]
    seeds = [7919 * i + 3 for i in range(len(flat))]
    objective = DFlashObjective(block_size=4, mask_token_id=4, num_anchors=6, loss_decay_gamma=3.0,
                                mask_kind="dense", chunk_rows=13, partition_anchors=partition, anchors_per_row=16)
    unpacked, unpacked_grads = run(objective, draft, target, collate(flat), seeds, source)
    packed, packed_grads = run(objective, draft, target, collate_packed(rows, PACK, len(rows)), seeds, source)
    assert packed.num_supervised == unpacked.num_supervised > 0
    assert torch.equal(packed.slot_count, unpacked.slot_count)
    torch.testing.assert_close(packed.slot_correct, unpacked.slot_correct)
    torch.testing.assert_close(packed.loss, unpacked.loss, rtol=1e-5, atol=1e-6)
    for name, grad in unpacked_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_mask_that_lets_chats_see_each_other_would_differ(target: TargetModel) -> None:
    """The comparison above can fail: with every row's tokens one chat to the mask (the labels still cut at
    each chat's end), the packed batch gives another loss."""
    draft = drafter(target)
    rows = chats(1, len(LAYERS) * target.hidden_size)
    objective = DFlashObjective(block_size=4, mask_token_id=4, num_anchors=6, loss_decay_gamma=3.0,
                                mask_kind="dense", anchors_per_row=16)
    batch = collate_packed(rows, PACK, len(rows))
    blocks = objective.seeded_blocks(batch, chat_layout(batch), list(range(6)))
    args = (draft, target.embed_tokens, target.lm_head.weight, batch["input_ids"], batch["loss_mask"],
            batch["features"])
    right = objective(*args, blocks=blocks, context_positions=batch["position_ids"])
    row_of = torch.arange(3)[:, None]
    context, anchors = torch.where(batch["sequence_ids"] >= 0, row_of, -1), torch.where(blocks.valid, row_of, -1)
    leaky = dataclasses.replace(objective)
    leaky.attention_mask = lambda b, _: packed_dense_mask(b.anchors, b.valid, anchors, context, 4)  # type: ignore[method-assign]
    wrong = leaky(*args, blocks=blocks, context_positions=batch["position_ids"])
    assert not torch.allclose(right.loss, wrong.loss, rtol=1e-4)


def test_a_flex_mask_of_64_token_tiles_gives_the_dense_mask_loss(target: TargetModel,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """training.flex_tile=64: the objective's flex mask is made of 64-token tiles, and the loss equals the dense
    mask's (flex attention on the CPU has no backward: the gradients are the GPU tests')."""
    from torch._inductor.choices import InductorChoices

    monkeypatch.setattr(InductorChoices, "get_flex_attention_bwd_configs", lambda self, *a, **k: [])  # unfitted
    draft = drafter(target)
    batch = collate_packed(chats(2, len(LAYERS) * target.hidden_size), PACK, 3)
    losses = {}
    for kind, tile in (("dense", 128), ("flex", 64)):
        objective = DFlashObjective(block_size=4, mask_token_id=4, num_anchors=6, loss_decay_gamma=3.0,
                                    mask_kind=kind, anchors_per_row=16, flex_tile=tile)
        blocks = objective.seeded_blocks(batch, chat_layout(batch), list(range(6)))
        if kind == "flex":
            assert tuple(objective.attention_mask(blocks, PACK).BLOCK_SIZE) == (64, 64)
            # the mask made outside the compiled layers fits inductor's backward candidates to it there
            assert getattr(InductorChoices.get_flex_attention_bwd_configs, "_dflash_fits_small_tiles", False)
        with torch.no_grad():
            losses[kind] = objective(draft, target.embed_tokens, target.lm_head.weight, batch["input_ids"],
                                     batch["loss_mask"], batch["features"], blocks=blocks,
                                     context_positions=batch["position_ids"]).loss
    torch.testing.assert_close(losses["flex"], losses["dense"], rtol=1e-5, atol=1e-6)
