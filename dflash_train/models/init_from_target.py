"""A new drafter's decoder layers initialised from the target's own decoder layers.

The drafter's layers have the target's width (docs/design.md §3), so each one can start as a copy of a
target layer: its attention projections, MLP and two layer norms. `q_norm`/`k_norm` are copied where
the target has them (Qwen3) and set to ones where it has none (Llama); the drafter still normalises its
queries and keys per head. The context fusion (`fc`, `hidden_norm`) and the final `norm` keep their own
initialisation: the target has nothing that plays their part.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dflash_train.models.config import drafter_intermediate_size
from dflash_train.models.draft import DFlashDraftModel

# Per-head query/key norms: Qwen3 layers have them, Llama layers do not.
OPTIONAL_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
SHAPE_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")


def default_init_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target's last `num_draft_layers` decoder layers."""
    return list(range(num_target_layers - num_draft_layers, num_target_layers))


def _target_shape(target_config: Any) -> dict[str, Any]:
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    heads = text.num_attention_heads
    return {
        "hidden_size": text.hidden_size, "num_attention_heads": heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
        "intermediate_size": drafter_intermediate_size(text), "hidden_act": getattr(text, "hidden_act", "silu"),
    }


def _shape_problems(draft: DFlashDraftModel, target_config: Any) -> list[str]:
    target = _target_shape(target_config)
    problems = [f"{field} {getattr(draft.config, field)} != target's {target[field]}" for field in SHAPE_FIELDS
                if getattr(draft.config, field) != target[field]]
    if target["hidden_act"] != "silu":
        problems.append(f"the target's MLP uses {target['hidden_act']}, the drafter's silu")
    return problems


def _layer_plan(draft_layer: nn.Module, target_layer: nn.Module, target_id: int
                ) -> tuple[list[tuple[torch.Tensor, torch.Tensor | None]], list[str]]:
    """(drafter tensor, target tensor or None for ones) pairs of one layer, and what does not fit."""
    source = dict(target_layer.named_parameters())
    plan, problems = [], []
    for name, param in draft_layer.named_parameters():
        tensor = source.pop(name, None)
        if tensor is None and name not in OPTIONAL_NORMS:
            problems.append(f"target layer {target_id} has no {name}")
        elif tensor is not None and tensor.shape != param.shape:
            problems.append(f"target layer {target_id} {name} is {tuple(tensor.shape)}, the drafter's "
                            f"{tuple(param.shape)}")
        else:
            plan.append((param, tensor))
    # A target tensor the drafter has no place for (a bias, an extra norm) makes another function.
    problems += [f"target layer {target_id} {name} has no place in the drafter" for name in source]
    return plan, problems


def init_layers_from_target(draft: DFlashDraftModel, target_config: Any, target_layers: nn.ModuleList,
                            layer_ids: list[int] | None = None) -> list[int]:
    """Copies target layer `layer_ids[i]` into drafter layer i (default: the target's last layers) and
    returns the ids; a target whose layers do not match the drafter's is refused in one line."""
    count = len(draft.layers)
    ids = default_init_layer_ids(len(target_layers), count) if layer_ids is None else list(layer_ids)
    if len(ids) != count or not all(0 <= i < len(target_layers) for i in ids):
        raise ValueError(f"model.init_layer_ids={ids} must name {count} of the target's layers "
                         f"0..{len(target_layers) - 1}")
    problems = _shape_problems(draft, target_config)
    plan: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    for draft_layer, target_id in zip(draft.layers, ids, strict=True):
        layer_plan, layer_problems = _layer_plan(draft_layer, target_layers[target_id], target_id)
        plan += layer_plan
        problems += layer_problems
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise ValueError(f"model.init_layers_from_target: the target's layers do not fit the drafter's ({shown})")
    with torch.no_grad():
        for param, tensor in plan:
            if tensor is None:
                param.fill_(1.0)
            else:
                param.copy_(tensor)
    return ids
