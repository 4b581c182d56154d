"""Which target layers feed the drafter.

A target layer id ``k`` names the output of decoder layer ``k`` (0-based), i.e. Hugging Face's
``hidden_states[k + 1]`` before the final norm (see ``dflash_train.features.capture``).
"""

from __future__ import annotations

from collections.abc import Sequence


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Spread one target layer per draft layer evenly over layers ``1 .. L-3``.

    ``round(1 + i * (L - 4) / (K - 1))`` for ``i in range(K)``, and ``[L // 2]`` for ``K == 1``.
    Rounding is Python's ``round`` (round half to even), as in the reference DFlash drafters: the
    36- and 32-layer cases never hit a tie, but a 30-layer target with 5 draft layers does
    (7.5 and 20.5), and only half-to-even gives the published ``[1, 8, 14, 20, 27]``.
    """
    if num_draft_layers < 1:
        raise ValueError(f"num_draft_layers must be at least 1, got {num_draft_layers}.")
    if num_target_layers < 3:
        raise ValueError(
            f"The target needs at least 3 decoder layers to feed a drafter, got {num_target_layers}."
        )
    if num_draft_layers == 1:
        ids = [num_target_layers // 2]
    else:
        span = num_target_layers - 4
        if num_draft_layers - 1 > span:
            raise ValueError(
                f"Cannot spread {num_draft_layers} distinct layer ids over layers 1..{num_target_layers - 3} of a "
                f"{num_target_layers}-layer target; use at most {max(span + 1, 1)} draft layers or set target_layer_ids."
            )
        ids = [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]
    # The last layer is never a default: its output only feeds the final norm and the lm_head.
    return validate_drafter_layer_ids(ids, num_target_layers)


def validate_target_layer_ids(ids: Sequence[int], num_target_layers: int) -> list[int]:
    """Check that ``ids`` are strictly increasing decoder-layer indices of the target; return them as a list."""
    ids = list(ids)
    if not ids:
        raise ValueError("target_layer_ids is empty; give at least one decoder layer index.")
    for layer_id in ids:
        # bool is an int subclass; True as a layer id is certainly a config mistake.
        if isinstance(layer_id, bool) or not isinstance(layer_id, int):
            raise ValueError(f"target_layer_ids must be integers, got {layer_id!r}.")
        if not 0 <= layer_id < num_target_layers:
            raise ValueError(
                f"Target layer id {layer_id} is out of range for a {num_target_layers}-layer target; "
                f"use ids in 0..{num_target_layers - 1}."
            )
    if len(set(ids)) != len(ids):
        raise ValueError(f"target_layer_ids {ids} contains duplicates; list each layer once.")
    if ids != sorted(ids):
        raise ValueError(f"target_layer_ids {ids} must be sorted in increasing order.")
    return ids


def validate_drafter_layer_ids(ids: Sequence[int], num_target_layers: int) -> list[int]:
    """``validate_target_layer_ids``, and the last layer refused: a drafter reads layer ``k`` as Hugging Face's
    ``hidden_states[k + 1]``, and for the last layer that entry is taken after the final norm, so serving
    runtimes would feed the drafter other values than it was trained on."""
    ids = validate_target_layer_ids(ids, num_target_layers)
    if ids[-1] > deepest_drafter_layer(num_target_layers):
        raise ValueError(
            f"Target layer id {ids[-1]} is the last layer of a {num_target_layers}-layer target, whose output "
            f"serving runtimes only see after the final norm; use ids in 0..{deepest_drafter_layer(num_target_layers)}."
        )
    return ids


def deepest_drafter_layer(num_target_layers: int) -> int:
    """The deepest target layer a drafter may read, ``L - 2`` (why: ``validate_drafter_layer_ids``)."""
    return num_target_layers - 2
