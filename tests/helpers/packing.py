"""Random chats in packed rows, a drafter for them, and one forward and backward of the objective, for the
tests that compare packed training with unpacked training."""

from __future__ import annotations

import torch

from dflash_train.features.capture import (
    capture_features,
    capture_features_and_final_states,
    packed_features_and_final_states,
)
from dflash_train.features.packed_rows import chat_layout
from dflash_train.models import DFlashConfig, DFlashDraftModel
from dflash_train.objective import DFlashObjective
from dflash_train.objective.objective import ObjectiveOutput
from dflash_train.target import TargetModel

LAYERS = [0, 2, 3]
ROWS = [[14, 21, 9], [30, 17], [11]]  # chat lengths per packed row
PACK = 48


def chats(seed: int, width: int) -> list[list[dict[str, torch.Tensor]]]:
    """A prompt (unsupervised), then a response with a few unsupervised holes, per chat."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for row in ROWS:
        samples = []
        for n in row:
            loss_mask = torch.rand(n, generator=gen) < 0.85
            loss_mask[: int(torch.randint(2, 5, (1,), generator=gen))] = False
            samples.append({"input_ids": torch.randint(7, 256, (n,), generator=gen), "loss_mask": loss_mask,
                            "features": torch.randn(n, width, generator=gen)})
        rows.append(samples)
    return rows


def drafter(target: TargetModel) -> DFlashDraftModel:
    config = DFlashConfig.from_target_config(target.config, mask_token_id=4, num_hidden_layers=2, block_size=4,
                                             target_layer_ids=LAYERS)
    torch.manual_seed(0)
    return DFlashDraftModel(config)


def run(objective: DFlashObjective, draft: DFlashDraftModel, target: TargetModel, batch: dict[str, torch.Tensor],
        seeds: list[int], source: str) -> tuple[ObjectiveOutput, dict[str, torch.Tensor]]:
    """One forward and backward; features stored (offline), computed by the target, or with soft targets."""
    positions = batch.get("position_ids")
    teacher = None
    if source == "offline":
        features = batch["features"]
    elif source == "soft":
        if positions is None:
            features, teacher = capture_features_and_final_states(target, batch["input_ids"], LAYERS)
        else:
            features, teacher = packed_features_and_final_states(target, batch["input_ids"], positions, LAYERS)
    else:
        features = capture_features(target, batch["input_ids"], LAYERS, position_ids=positions)
    blocks = objective.seeded_blocks(batch, chat_layout(batch), seeds)
    draft.zero_grad()
    out = objective(draft, target.embed_tokens, target.lm_head.weight, batch["input_ids"], batch["loss_mask"],
                    features, blocks=blocks, teacher_states=teacher, context_positions=positions)
    out.loss.backward()
    return out, {name: p.grad.clone() for name, p in draft.named_parameters()}
