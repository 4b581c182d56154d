"""Does a drafter fit a target? One-line errors that say what to do."""

from __future__ import annotations

import logging

from dflash_train.features.layer_ids import validate_drafter_layer_ids
from dflash_train.models import DFlashDraftModel
from dflash_train.target import TargetModel

logger = logging.getLogger(__name__)


def check_compatible(draft: DFlashDraftModel, target: TargetModel, block_size: int) -> None:
    config = draft.config
    fix = "pass the drafter trained for this target (or the target it was trained for)"
    if config.hidden_size != target.hidden_size:
        raise ValueError(f"drafter hidden size {config.hidden_size} != target hidden size {target.hidden_size}; {fix}")
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"drafter vocabulary {config.vocab_size} != target embedding rows {target.vocab_size}; {fix}")
    try:
        validate_drafter_layer_ids(config.target_layer_ids, target.num_layers)
    except ValueError as error:
        raise ValueError(f"{str(error).rstrip('.')} (the drafter's target_layer_ids); {fix}") from None
    if not 0 <= config.mask_token_id < target.vocab_size:
        raise ValueError(f"drafter mask token {config.mask_token_id} is outside the target's {target.vocab_size} "
                         f"embedding rows; {fix}")
    if config.num_target_layers != target.num_layers:
        logger.warning("drafter was trained for a %d-layer target, this one has %d layers",
                       config.num_target_layers, target.num_layers)
    if block_size < 1:
        raise ValueError(f"--block-size must be at least 1, got {block_size}")
    if block_size > config.block_size:
        logger.warning("block size %d exceeds the drafter's trained block size %d: expect low acceptance",
                       block_size, config.block_size)
