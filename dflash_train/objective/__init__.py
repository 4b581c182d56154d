from dflash_train.objective.blocks import IGNORE_INDEX, Blocks, build_blocks, sample_anchors
from dflash_train.objective.distill import Distillation, chunked_distillation_rows
from dflash_train.objective.loss import chunked_weighted_cross_entropy, slot_weights
from dflash_train.objective.masks import dense_mask, flex_mask
from dflash_train.objective.objective import (
    DEFAULT_FLEX_TILE,
    DFlashObjective,
    ObjectiveOutput,
    expected_acceptance_length,
)

__all__ = [
    "DEFAULT_FLEX_TILE",
    "IGNORE_INDEX",
    "Blocks",
    "DFlashObjective",
    "Distillation",
    "ObjectiveOutput",
    "build_blocks",
    "chunked_distillation_rows",
    "chunked_weighted_cross_entropy",
    "dense_mask",
    "expected_acceptance_length",
    "flex_mask",
    "sample_anchors",
    "slot_weights",
]
