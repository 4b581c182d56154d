"""The drafter's teacher-forced accuracy on the eval's own answers: the training validation metric, measured
on the eval prompts.

For every answer of the target (the reference pass), one block is anchored at every answer position, as in
training, and the drafter's top-1 prediction of each slot is compared with the target's answer. The per-slot
accuracies and the τ they imply (1 + Σ_k Π_{i≤k} acc_i, the training `expected_acceptance_length`) describe
the drafter at uniformly spread positions. The decode loop's τ describes it where its cycles start — right
after the position where the previous draft failed. A gap between the two that the held-out training data
does not show comes from where cycles start; a low value here comes from the prompts themselves.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dflash_train.features.capture import capture_features
from dflash_train.models import DFlashDraftModel
from dflash_train.objective import DFlashObjective, build_blocks, expected_acceptance_length
from dflash_train.objective.blocks import anchor_candidates
from dflash_train.target import TargetModel

# Blocks never see each other, so any split gives the same predictions; the split bounds the dense mask and the
# drafter's activations (the cross-entropy chunks its logits itself). One pass covers a 256-token answer: at 64 a
# pass the eval's teacher-forced phase was slow for SmolLM2, mostly kernel launches (docs/benchmarks.md, 'Figures
# behind code choices').
ANCHORS_PER_PASS = 256


class TeacherForcedAccuracy:
    def __init__(self, target: TargetModel, draft: DFlashDraftModel, block_size: int,
                 anchors_per_pass: int = ANCHORS_PER_PASS) -> None:
        self.target, self.draft, self.block_size = target, draft, block_size
        self.anchors_per_pass = anchors_per_pass
        self.correct = torch.zeros(block_size, dtype=torch.float64)
        self.count = torch.zeros(block_size, dtype=torch.float64)

    @torch.no_grad()
    def add(self, prompt: list[int], answer: list[int]) -> None:
        """Blocks at every answer position that has a next answer token (anchors need a supervised successor)."""
        device = self.target.device
        ids = torch.tensor([prompt + answer], device=device)
        loss_mask = torch.zeros_like(ids, dtype=torch.bool)
        loss_mask[:, len(prompt):] = True
        all_anchors = anchor_candidates(loss_mask)[0].nonzero().flatten()  # sorted
        if all_anchors.numel() == 0:
            return
        config = self.draft.config
        # Features in the eval target's own dtype: what the decode loop hands the drafter.
        features = capture_features(self.target, ids, config.target_layer_ids)
        # Dense mask: one shape per request would recompile compiled flex attention every time.
        objective = DFlashObjective(block_size=self.block_size, mask_token_id=config.mask_token_id,
                                    num_anchors=self.anchors_per_pass, loss_decay_gamma=math.inf, mask_kind="dense")
        for anchors in all_anchors.split(self.anchors_per_pass):
            anchors = anchors[None]
            blocks = build_blocks(ids, loss_mask, anchors, torch.ones_like(anchors, dtype=torch.bool),
                                  self.block_size, config.mask_token_id)
            out = objective(self.draft, self.target.embed_tokens, self.target.lm_head.weight, ids, loss_mask,
                            features, blocks=blocks)
            self.correct += out.slot_correct.double().cpu()
            self.count += out.slot_count.double().cpu()

    def result(self) -> dict[str, Any]:
        accuracy = (self.correct / self.count.clamp_min(1))[1:]
        accuracy = torch.where(self.count[1:] > 0, accuracy, torch.full_like(accuracy, math.nan))
        return {
            "teacher_forced_slot_accuracy": [None if math.isnan(a) else round(float(a), 5) for a in accuracy],
            "teacher_forced_acceptance_length": float(expected_acceptance_length(accuracy)),
        }
