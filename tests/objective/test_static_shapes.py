"""Blocks padded to a fixed number of supervised rows and chats (`Blocks.padded`, what a captured training step
replays) give the loss, gradients and metrics of the same blocks unpadded: padding entries weigh nothing, hit
nothing and count nowhere."""

from __future__ import annotations

import pytest
import torch

from dflash_train.features.capture import packed_features_and_final_states
from dflash_train.features.packed_rows import chat_layout, collate_packed
from dflash_train.objective import DFlashObjective
from dflash_train.objective.blocks import Blocks
from dflash_train.objective.distill import Distillation
from dflash_train.objective.objective import ObjectiveOutput
from dflash_train.target import TargetModel
from dflash_train.training.data import collate
from tests.helpers.packing import LAYERS, PACK, chats, drafter
from tests.helpers.tiny_models import make_tiny_target


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return make_tiny_target("qwen3", num_layers=5)


def seeded(objective: DFlashObjective, batch: dict[str, torch.Tensor]) -> Blocks:
    layout = chat_layout(batch)
    return objective.seeded_blocks(batch, layout, [7919 * i + 3 for i in range(len(layout))])


def forward_backward(objective: DFlashObjective, target: TargetModel, batch: dict[str, torch.Tensor],
                     pad: tuple[int, int] | None) -> tuple[ObjectiveOutput, dict[str, torch.Tensor]]:
    draft = drafter(target)
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])
    features, teacher = packed_features_and_final_states(target, batch["input_ids"], positions, LAYERS)
    blocks = seeded(objective, batch)
    if pad is not None:
        blocks = blocks.padded(*pad)
    out = objective(draft, target.embed_tokens, target.lm_head.weight, batch["input_ids"], batch["loss_mask"],
                    features, blocks=blocks, teacher_states=teacher, context_positions=batch.get("position_ids"))
    out.loss.backward()
    return out, {name: p.grad.clone() for name, p in draft.named_parameters()}


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("weighting", ["decay", "dpace"])
@pytest.mark.parametrize("loss", ["ce", "kl"])
def test_padded_blocks_give_the_loss_gradients_and_metrics_of_the_blocks(
        target: TargetModel, packed: bool, weighting: str, loss: str) -> None:
    rows = chats(0, len(LAYERS) * target.hidden_size)
    batch = collate_packed(rows, PACK, len(rows)) if packed else collate([c for row in rows for c in row])
    objective = DFlashObjective(block_size=4, mask_token_id=4, num_anchors=6, loss_decay_gamma=3.0,
                                mask_kind="dense", chunk_rows=13, anchors_per_row=16 if packed else None,
                                position_weighting=weighting,  # type: ignore[arg-type]
                                distillation=None if loss == "ce" else Distillation("kl", 1.0, 1.0))
    plain, plain_grads = forward_backward(objective, target, batch, None)
    padded, padded_grads = forward_backward(objective, target, batch, (plain.num_supervised + 37, 11))
    assert padded.num_supervised == plain.num_supervised > 0
    torch.testing.assert_close(padded.loss, plain.loss, rtol=1e-6, atol=1e-7)
    assert torch.equal(padded.slot_count, plain.slot_count) and torch.equal(padded.slot_correct, plain.slot_correct)
    chats_here = plain.sequence_loss.numel()
    torch.testing.assert_close(padded.sequence_loss[:chats_here], plain.sequence_loss, rtol=1e-6, atol=1e-7)
    assert torch.equal(padded.sequence_slot_count[:chats_here], plain.sequence_slot_count)
    if packed:  # room for 11 chats: those past the batch's 6 have nothing
        assert padded.sequence_loss.numel() == 11 and not padded.sequence_slot_count[chats_here:].any()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(padded_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_padding_entry_that_counted_would_show(target: TargetModel) -> None:
    """The comparison above can fail: padding entries given weight (as real rows) change the loss."""
    rows = chats(0, len(LAYERS) * target.hidden_size)
    batch = collate_packed(rows, PACK, len(rows))
    objective = DFlashObjective(block_size=4, mask_token_id=4, num_anchors=6, loss_decay_gamma=3.0,
                                mask_kind="dense", anchors_per_row=16)
    plain, _ = forward_backward(objective, target, batch, None)
    blocks = seeded(objective, batch)
    counted = blocks.padded(plain.num_supervised + 37, 6)
    counted.real_rows = torch.ones_like(counted.real_rows)
    features, _ = packed_features_and_final_states(target, batch["input_ids"], batch["position_ids"], LAYERS)
    wrong = objective(drafter(target), target.embed_tokens, target.lm_head.weight, batch["input_ids"],
                      batch["loss_mask"], features, blocks=counted, context_positions=batch["position_ids"])
    assert not torch.allclose(wrong.loss, plain.loss, rtol=1e-4)


def test_a_batch_larger_than_the_capacity_is_refused(target: TargetModel) -> None:
    rows = chats(0, len(LAYERS) * target.hidden_size)
    batch = collate_packed(rows, PACK, len(rows))
    objective = DFlashObjective(block_size=4, mask_token_id=4, num_anchors=6, anchors_per_row=16)
    blocks = seeded(objective, batch)
    with pytest.raises(ValueError, match="do not fit a capacity of 3"):
        blocks.padded(3, 6)
