"""The features a target capture promises, computed the plain way, for the capture tests."""

from __future__ import annotations

import torch

from dflash_train.target import TargetModel

LAYER_IDS = [0, 2, 4]  # deepest is 4 of 6, so layer 5, the final norm and the lm_head must not run


def reference_features(
    target: TargetModel, input_ids: torch.Tensor, layer_ids: list[int], **kwargs
) -> torch.Tensor:
    """The features the contract promises, from a plain forward that keeps every hidden state."""
    with torch.no_grad():
        out = target.model(input_ids=input_ids, output_hidden_states=True, use_cache=False, **kwargs)
    return torch.cat([out.hidden_states[k + 1] for k in layer_ids], dim=-1)
