"""How many distinct experts a verify's block reaches in each MoE layer of a model: the number that sets what
the experts kernel can spread over the GPU at a verify's width (`kernels/decode_experts.py` runs one program
row per distinct expert), and the bytes a verify must read.

Counted from the top-k ids each experts module is called with (transformers' experts interface:
`forward(hidden_states, top_k_index, top_k_weights)`), over the last `block` positions of one forward.
"""

from __future__ import annotations

from typing import Any

import torch

from dflash_train.runtime.experts import experts_modules


@torch.no_grad()
def experts_reached(model: torch.nn.Module, input_ids: torch.Tensor, block: int) -> list[int]:
    """Distinct experts the last `block` tokens of each row of `input_ids` [rows, T] reach, summed over rows,
    per experts module in the model's order (empty for a model without experts)."""
    counts: list[int] = []
    rows = input_ids.shape[0]

    def count(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]  # [rows * T, k]
        per_row = index.reshape(rows, -1, index.shape[-1])[:, -block:]  # [rows, block, k]
        counts.append(sum(int(row.unique().numel()) for row in per_row))

    hooks = [module.register_forward_pre_hook(count, with_kwargs=True) for module in experts_modules(model)]
    try:
        model(input_ids=input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    return counts


def summary(counts: list[int], experts: int, block: int, top_k: int, rows: int = 1) -> dict[str, Any]:
    """The per-layer counts, their median, and what even routing would reach: rows·E·(1 − (1 − k/E)^block)."""
    ordered = sorted(counts)
    return {"verify_experts_reached": counts,
            "verify_experts_reached_median": ordered[len(ordered) // 2] if ordered else None,
            "verify_experts_reached_even": rows * experts * (1 - (1 - top_k / experts) ** block)}
