"""Validation metrics per data source: a mix of corpora reports one τ̂ per corpus, not only the mix's.

Each chat's loss, slot hits and slot counts (from the objective's per-sequence outputs) are summed per
source over the validation split and over the ranks, then summarised exactly as the whole split is: the
loss is the mean over the source's chats of each chat's loss, the slot accuracies pool the source's hits
and counts, and τ̂ follows from them. The sources' slot hits, slot counts and chat-weighted losses add
up to the overall ones; their τ̂ does not average to the overall τ̂ (it is not linear in the accuracies).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dflash_train.objective.objective import ObjectiveOutput, expected_acceptance_length


def slot_summary(correct: torch.Tensor, count: torch.Tensor) -> dict[str, Any]:
    """The slot metrics of pooled hits and counts [B]: one definition for train, validation and sources."""
    accuracy = (correct.double() / count.double())[1:]
    return {
        "supervised_slots": float(count.sum()),  # block slots with a label: what the step learns from
        "slot_accuracy": [round(float(a), 5) for a in accuracy],
        "mean_slot_accuracy": float(torch.nan_to_num(accuracy).mean()),
        "expected_acceptance_length": float(expected_acceptance_length(accuracy)),
    }


def source_names(sources: Sequence[str] | None) -> list[str]:
    """The sources worth a breakdown, sorted (the same order on every rank): none unless at least two."""
    names = sorted(set(sources or ()))
    return names if len(names) >= 2 else []


class SourceTotals:
    """Sums over one validation pass, per source: chat losses, chats, slot hits and slot counts."""

    def __init__(self, names: list[str], block_size: int, device: torch.device) -> None:
        self.names = names
        self.index = {name: i for i, name in enumerate(names)}
        self.loss = torch.zeros(len(names), device=device, dtype=torch.float64)
        self.chats = torch.zeros(len(names), device=device, dtype=torch.float64)
        self.correct = torch.zeros(len(names), block_size, device=device, dtype=torch.float64)
        self.count = torch.zeros(len(names), block_size, device=device, dtype=torch.float64)

    def add(self, sources: Sequence[str], out: ObjectiveOutput) -> None:
        """One forward's chats: `sources[k]` is the source of the batch's sequence k (a row, or a packed
        chat, in batch order). Chats without supervised slots count nowhere, as in the overall loss."""
        if out.sequence_loss is None or out.sequence_slot_correct is None or out.sequence_slot_count is None:
            raise ValueError("per-source validation needs the objective's per-sequence outputs")
        source = torch.tensor([self.index[s] for s in sources], device=self.loss.device)
        counts = out.sequence_slot_count.double()
        self.loss.index_add_(0, source, out.sequence_loss.double())
        self.chats.index_add_(0, source, (counts.sum(1) > 0).double())
        self.correct.index_add_(0, source, out.sequence_slot_correct.double())
        self.count.index_add_(0, source, counts)

    def reduce(self, reduce: Any) -> None:
        """Sums over the ranks; `reduce` is `accelerator.reduce` (every rank calls it, in the same order)."""
        self.loss, self.chats = reduce(self.loss, reduction="sum"), reduce(self.chats, reduction="sum")
        self.correct, self.count = reduce(self.correct, reduction="sum"), reduce(self.count, reduction="sum")

    def metrics(self) -> dict[str, dict[str, Any]]:
        """name -> {loss, chats, supervised_slots, slot_accuracy, mean_slot_accuracy, expected_acceptance_length}."""
        out = {}
        for i, name in enumerate(self.names):
            chats = float(self.chats[i])
            out[name] = {"loss": float(self.loss[i]) / max(1.0, chats), "chats": int(chats),
                         **slot_summary(self.correct[i], self.count[i])}
        return out


def source_line(by_source: dict[str, dict[str, Any]]) -> str:
    """One line per validation: `validation by source: a τ̂ 1.61 loss 2.40 · b τ̂ 3.02 loss 1.10`."""
    parts = [f"{name} τ̂ {m['expected_acceptance_length']:.2f} loss {m['loss']:.3f}" for name, m in by_source.items()]
    return "validation by source: " + " · ".join(parts)
