"""The validation pass: the held-out chats through the drafter with fixed anchors, every rank running as many
forwards as the busiest one, the loss and per-slot figures summed over the ranks (and per data source where
the split mixes several).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch

from dflash_train.objective import ObjectiveOutput
from dflash_train.training.batch_loading import anchor_seed
from dflash_train.training.source_metrics import SourceTotals, source_names


def detached(out: ObjectiveOutput) -> ObjectiveOutput:
    """The objective's outputs without their autograd history."""
    return dataclasses.replace(out, **{field.name: value.detach() for field in dataclasses.fields(out)
                                       if isinstance(value := getattr(out, field.name), torch.Tensor)})


class ValidationMixin:
    """The Trainer's validation pass. Relies on the Trainer's `config`, `accelerator`, `model`, `objective`,
    `packed`, `val_ids`, `val_groups`, `val_sources` and `_distributed_type`, on
    `BatchLoadingMixin._load_rows` and on `TrainStepMixin`'s `_forward` and `_reduce`."""

    def validate(self) -> dict[str, Any] | None:
        if not self.val_ids:
            return None
        # Compiled layers, unwrapped drafter: the training graph serves validation (train mode, gradients
        # recorded, no backward); eval mode or no_grad would compile the layer once more, for inference (a
        # compilation in the first validation, docs/training.md). The drafter has no dropout, so both compute
        # the same. A drafter wrapped by DDP, FSDP or DeepSpeed expects a backward after a forward with gradients.
        on_training_graph = self.config.training.compile and self._distributed_type() == "NO"
        with torch.set_grad_enabled(on_training_graph):
            if not on_training_graph:
                self.model.eval()
            return self._validate()

    def _validate(self) -> dict[str, Any]:
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        loss_sum, correct, count = 0.0, None, None
        by_source = self._source_totals()
        for indices, cpu_batch, weight in self._validation_batches(rank, world):
            seeds = [anchor_seed(self.config.training.seed, 0, i) for i in indices]  # fixed anchors
            with self.accelerator.autocast():
                out, _ = self._forward(indices, seeds, cpu_batch)
            out = detached(out)  # nothing here may keep a batch's autograd graph (see `validate`)
            if weight is None:  # a stand-in forward
                continue
            loss_sum += float(out.loss) * weight
            correct = out.slot_correct if correct is None else correct + out.slot_correct
            count = out.slot_count if count is None else count + out.slot_count
            if by_source is not None:
                by_source.add([self.val_sources[i] for i in indices], out)
        if correct is None:  # fewer validation samples than ranks
            zeros = torch.zeros(self.objective.block_size, device=self.accelerator.device)
            correct, count = zeros, zeros.clone()
        metrics = self._reduce(loss_sum, (0.0, 0.0, 0.0), correct, count)
        metrics.pop("grad_norm")
        chats = len(self.val_ids) if self.packed is None else sum(map(self.packed.counted_chats, self.val_groups))
        metrics["loss"] = metrics["loss"] * world / max(1, chats)
        if by_source is not None:
            by_source.reduce(self.accelerator.reduce)
            metrics["by_source"] = by_source.metrics()
        return metrics

    def _source_totals(self) -> SourceTotals | None:
        """Per-source sums for a validation split of two sources or more (None: nothing to break down)."""
        names = source_names([self.val_sources[i] for i in self.val_ids] if self.val_sources else None)
        if not names:
            return None
        return SourceTotals(names, self.objective.block_size, self.accelerator.device)

    def _validation_batches(
        self, rank: int, world: int
    ) -> Iterator[tuple[list[int], dict[str, torch.Tensor] | None, int | None]]:
        """This rank's validation micro-batches: (sample indices, CPU batch or None to load them, the
        chats its loss averages over; None for a stand-in). Every rank runs as many forwards as the rank
        with the most: a DDP/FSDP forward is a collective, and a rank that stopped early would leave the
        others waiting for ever; a rank that ran out runs a stand-in forward, not counted."""
        if self.packed is not None:
            groups = self.val_groups
            for k in range(math.ceil(len(groups) / world)):
                mine = groups[k * world + rank] if k * world + rank < len(groups) else None
                rows = mine or groups[0]
                weight = self.packed.counted_chats(mine) if mine else None
                yield [i for row in rows for i in row], self._load_rows(rows), weight
            return
        mine, size = self.val_ids[rank::world], self.config.training.batch_size
        batches = math.ceil(math.ceil(len(self.val_ids) / world) / size)
        for start in range(0, batches * size, size):
            indices = mine[start : start + size]
            yield indices or self.val_ids[:1], None, len(indices) if indices else None
