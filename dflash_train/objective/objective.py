"""One training step's loss and metrics for a batch of sequences with target features."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from dflash_train.models.draft import DFlashDraftModel
from dflash_train.models.flex_backward_configs import fit_backward_configs_to_small_tiles
from dflash_train.objective.blocks import (
    IGNORE_INDEX,
    Blocks,
    build_blocks,
    build_packed_blocks,
    sample_anchors,
    sample_anchors_seeded,
    sample_packed_anchors,
)
from dflash_train.objective.distill import Distillation, chunked_distillation_rows
from dflash_train.objective.loss import chunked_cross_entropy_rows, slot_weights
from dflash_train.objective.masks import dense_mask, flex_mask, packed_dense_mask, packed_flex_mask

DEFAULT_FLEX_TILE = 128  # flex attention's own tile; smaller ones need kernel options of their own

MaskKind = Literal["auto", "dense", "flex"]
PositionWeighting = Literal["decay", "dpace"]


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor  # scalar, differentiable
    slot_correct: torch.Tensor  # [B] float: top-1 hits per slot (slot 0 always 0)
    slot_count: torch.Tensor  # [B] float: supervised rows per slot
    num_supervised: int
    # Per sequence (a row, or a chat of a packed row), detached, for metrics broken down by chat (per data
    # source in validation): each one's own loss, 0 without supervised rows ([n]; `loss` is their mean over
    # the sequences with any), and its slot_correct / slot_count ([n, B]; they sum to the batch's).
    sequence_loss: torch.Tensor | None = None
    sequence_slot_correct: torch.Tensor | None = None
    sequence_slot_count: torch.Tensor | None = None

    @property
    def slot_accuracy(self) -> torch.Tensor:
        """Top-1 accuracy of slots 1..B-1, [B-1] (nan where a slot had no label)."""
        return (self.slot_correct / self.slot_count)[1:]

    @property
    def expected_acceptance_length(self) -> torch.Tensor:
        return expected_acceptance_length(self.slot_accuracy)


def expected_acceptance_length(slot_accuracy: torch.Tensor) -> torch.Tensor:
    """tau implied by per-slot accuracies: 1 (bonus) + sum_k prod_{i<=k} acc_i."""
    return 1.0 + torch.cumprod(torch.nan_to_num(slot_accuracy, nan=0.0), dim=0).sum()


def sequence_normalised_weights(weights: torch.Tensor, sequence: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """Row weights so that the loss is the mean over sequences of each sequence's weighted mean.

    Averaging per sequence (not per row) makes the loss of a batch independent of how it is split
    into data-parallel ranks or accumulation steps, which is what makes multi-GPU runs match.
    """
    per_sequence = torch.zeros(num_sequences, device=weights.device).index_add(0, sequence, weights)
    return per_sequence_mean(weights, sequence, per_sequence)


def dpace_block_weights(ce: torch.Tensor, labelled: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE weights (arXiv 2605.18810) of blocks [..., B] from their per-slot cross-entropies, detached.

    q_k = exp(-CE_k) is the drafter's probability of slot k's label, smoothed to q~_k = (1-a)·q_k + a; slot
    j weighs w_j = sum_{m >= j} prod_{i <= m} q~_i over slots 1..B-1, the gradient of the expected accepted
    length sum_m prod_{i<=m} q~_i w.r.t. log q~_j. A slot without a label ends the block's chain (nothing
    past it can be accepted): it and every later slot weigh 0. Slot 0, the anchor, never has a label.
    """
    smoothed = (1 - alpha) * torch.exp(-ce.detach().float()) + alpha
    smoothed = torch.where(labelled, smoothed, torch.zeros_like(smoothed))
    smoothed[..., 0] = 1.0  # the anchor is given, not drafted: it starts every chain
    prefix = smoothed.cumprod(dim=-1)  # 0 from the first unlabelled slot on
    weights = prefix.flip(-1).cumsum(dim=-1).flip(-1)
    return torch.where(labelled, weights, torch.zeros_like(weights))


def per_sequence_mean(weights: torch.Tensor, sequence: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Row weights [P] divided by their sequence's count [num_sequences] and by the number of sequences
    that count (> 0), so that the weighted sum of row losses is a mean over sequences."""
    present = (counts > 0).sum().clamp_min(1)
    return weights / counts[sequence].clamp_min(1e-12) / present


@dataclass
class DFlashObjective:
    """Anchors -> blocks -> masked drafter forward -> position-weighted CE over valid slots only.

    The loss is each sequence's decay-weighted mean CE over its supervised slots (with D-PACE: its
    D-PACE-weighted CE summed over its blocks, divided by their number), averaged over the sequences of
    the batch; a sequence is a row, or a chat of a packed row. With a `distillation`, a row's CE is replaced
    by its mix with a divergence from the target's distribution (objective/distill.py), weighted the same way.
    """

    block_size: int
    mask_token_id: int
    num_anchors: int  # anchors drawn per row (unpacked) when no blocks are given; the default is training's
    loss_decay_gamma: float | None = None  # None: paper default for the block size; inf: no decay
    mask_kind: MaskKind = "auto"
    chunk_rows: int | None = None
    partition_anchors: bool = False  # anchors on a fixed block grid instead of at random (an ablation)
    anchors_per_row: int | None = None  # anchor capacity of a packed row
    position_weighting: PositionWeighting = "decay"  # dpace: D-PACE weights from the drafter's own CE
    dpace_alpha: float = 0.5  # D-PACE smoothing: q~ = (1 - alpha)·q + alpha
    flex_tile: int = DEFAULT_FLEX_TILE  # the flex mask's tile (queries and keys); 64 computes fewer masked-out scores
    # The per-row loss: None, the label's CE (or soft targets'); else mixed with a divergence from the target's
    # distribution at a temperature (objective/distill.py), which needs `teacher_states`.
    distillation: Distillation | None = None
    # The decay's slot weights, made once per device: a step captured in a CUDA graph may not copy from the host.
    _slot_decay: dict[torch.device, torch.Tensor] = field(default_factory=dict, init=False, repr=False,
                                                          compare=False)

    def slot_decay(self, device: torch.device) -> torch.Tensor:
        """The decay's weights [B] of the block's slots, on `device`."""
        if device not in self._slot_decay:
            self._slot_decay[device] = slot_weights(self.block_size, self.loss_decay_gamma).to(device)
        return self._slot_decay[device]

    def make_blocks(
        self, input_ids: torch.Tensor, loss_mask: torch.Tensor, generator: torch.Generator | None = None
    ) -> Blocks:
        anchors, valid = sample_anchors(loss_mask, self.num_anchors, generator)
        return build_blocks(input_ids, loss_mask, anchors, valid, self.block_size, self.mask_token_id)

    def seeded_blocks(
        self, batch: dict[str, torch.Tensor], chats: list[tuple[int, int, int]], seeds: list[int]
    ) -> Blocks:
        """Blocks of a batch, unpacked or packed (it has `sequence_ids`): chat i at (row, start, length)
        `chats[i]` gets the anchors its own seed draws over its own tokens, wherever it lies."""
        partition = self.block_size if self.partition_anchors else None
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        if "sequence_ids" not in batch:
            lengths = [n for _, _, n in chats]
            anchors, valid = sample_anchors_seeded(loss_mask, self.num_anchors, seeds, lengths, partition)
            return build_blocks(input_ids, loss_mask, anchors, valid, self.block_size, self.mask_token_id)
        if self.anchors_per_row is None:
            raise ValueError("packed batches need the objective's anchors_per_row")
        anchors, valid = sample_packed_anchors(loss_mask, chats, seeds, self.num_anchors, self.anchors_per_row,
                                               partition)
        return build_packed_blocks(input_ids, loss_mask, batch["position_ids"], batch["sequence_ids"], anchors,
                                   valid, self.block_size, self.mask_token_id, len(chats))

    def attention_mask(self, blocks: Blocks, context_len: int) -> torch.Tensor | object:
        kind = self.mask_kind
        if kind == "auto":
            kind = "flex" if blocks.anchors.is_cuda else "dense"
        if kind == "flex" and self.flex_tile < DEFAULT_FLEX_TILE:  # here, not inside the compiled layers
            fit_backward_configs_to_small_tiles()
        if blocks.context_sequence is not None:
            if kind == "flex":
                return packed_flex_mask(blocks.anchors, blocks.valid, blocks.sequence, blocks.context_sequence,
                                        self.block_size, self.flex_tile)
            return packed_dense_mask(blocks.anchors, blocks.valid, blocks.sequence, blocks.context_sequence,
                                     self.block_size)
        if kind == "flex":
            return flex_mask(blocks.anchors, blocks.valid, context_len, self.block_size, self.flex_tile)
        return dense_mask(blocks.anchors, blocks.valid, context_len, self.block_size)

    def __call__(
        self,
        draft: DFlashDraftModel,
        embed_tokens: nn.Module,
        head_weight: torch.Tensor,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        context_features: torch.Tensor,
        generator: torch.Generator | None = None,
        blocks: Blocks | None = None,
        teacher_states: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
    ) -> ObjectiveOutput:
        """input_ids/loss_mask [b, S], context_features [b, S, K*H] from the frozen target; teacher_states
        [b, S, H] (the target's final hidden states) turn the labels into the target's soft distribution (or
        give the distillation its target distribution);
        context_positions [b, S] (packed rows: each chat's own) default to 0..S-1."""
        blocks = blocks or self.make_blocks(input_ids, loss_mask, generator)
        context_len = input_ids.shape[1]
        if context_positions is None:
            context_positions = torch.arange(context_len, device=input_ids.device).expand(input_ids.shape[0], -1)
        with torch.no_grad():
            block_embeds = embed_tokens(blocks.input_ids)  # [b, N*B, H], frozen
        hidden = draft(
            block_embeds,
            blocks.positions,
            context_features,
            context_positions,
            self.attention_mask(blocks, context_len),
        )
        return self.loss_from_hidden(hidden, head_weight, blocks, teacher_states)

    def loss_from_hidden(self, hidden: torch.Tensor, head_weight: torch.Tensor, blocks: Blocks,
                         teacher_states: torch.Tensor | None = None) -> ObjectiveOutput:
        # The supervised rows are picked by their flat indices, not by a boolean mask: a mask index waits for
        # the device to count its rows (a host sync in the middle of the step), and blocks built on the host
        # bring the indices with them (`Blocks.supervised_rows`).
        rows_index = blocks.supervised_index()  # [P]
        real = blocks.real_rows  # [P] bool with padding entries (`Blocks.padded`), else None: every row real
        slots = blocks.slots.expand_as(blocks.labels)
        # [P, H]: the head never sees unsupervised rows. index_select, not an index: its backward adds the rows'
        # gradients back in one pass, where an index's backward sorts the indices first (a real share of a
        # small drafter's step); padding entries repeat an index, with a gradient of exactly 0.
        rows = hidden.flatten(0, 1).index_select(0, rows_index)
        labels, row_slots = blocks.labels.flatten()[rows_index], slots.flatten()[rows_index]
        if real is not None:  # a batch without supervised rows pads with row 0, whose label is ignored: any token
            labels = labels.clamp_min(0)
        teacher = None
        if teacher_states is not None:  # the target predicts token p from its state at p - 1 (row indices)
            batch_row = rows_index // blocks.labels.shape[1]
            teacher = teacher_states[batch_row, blocks.token_index.flatten()[rows_index] - 1]
        counted = torch.ones_like(labels, dtype=torch.float32) if real is None else real.float()
        row_loss, row_ce, correct = self._row_losses(rows, head_weight, labels, teacher)
        correct = correct.float() * counted
        # D-PACE reads the label's CE (its weights are the drafter's probability of the label), whatever the loss.
        weighted = row_loss * self.row_weights(row_ce, blocks, rows_index, counted)
        loss = weighted.sum()
        zeros = torch.zeros(self.block_size, device=hidden.device)
        slot_correct = zeros.index_add(0, row_slots, correct)
        slot_count = zeros.index_add(0, row_slots, counted)
        sequence, num_sequences = self._sequences(blocks)
        per_sequence = self._per_sequence(weighted.detach(), correct, counted, sequence.flatten()[rows_index],
                                          row_slots, num_sequences)
        supervised = int(rows_index.numel()) if blocks.num_real_rows is None else blocks.num_real_rows
        return ObjectiveOutput(loss, slot_correct, slot_count, supervised, *per_sequence)

    @property
    def distils(self) -> bool:
        """Whether the loss reads the target's distribution through a divergence (a weight of 0 is the CE)."""
        return self.distillation is not None and self.distillation.weight > 0

    def _row_losses(self, rows: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                    teacher: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss [P], the label's CE [P], top-1 hits [P]) of the supervised rows [P, H]; teacher [P, H]: the
        target's states that predict them (soft targets, or the distillation's target distribution)."""
        if not self.distils:
            # Without a distillation the teacher's states are soft targets; a distillation of weight 0 is the
            # hard labels' CE, whatever states come with it.
            row_ce, correct = chunked_cross_entropy_rows(rows, head_weight, labels, self.chunk_rows,
                                                         teacher if self.distillation is None else None)
            return row_ce, row_ce, correct
        if teacher is None:
            raise ValueError(f"the {self.distillation.kind} loss distils the target's distribution: pass "
                             "teacher_states, the target's final hidden states (online features)")
        return chunked_distillation_rows(rows, head_weight, labels, teacher, self.distillation, self.chunk_rows)

    def _per_sequence(
        self, weighted: torch.Tensor, correct: torch.Tensor, counted: torch.Tensor, sequence: torch.Tensor,
        slots: torch.Tensor, n: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each sequence's own loss [n] and its slot hits and counts [n, B], from the supervised rows' weighted
        CE, top-1 hits, counts (0 for padding) sequences and slots [P]. The row weights divide every sequence's
        loss by the number of sequences with supervised rows (the loss is their mean), multiplied back here."""
        cells = sequence * self.block_size + slots
        zeros = torch.zeros(n * self.block_size, device=weighted.device)
        hits = zeros.index_add(0, cells, correct).view(n, self.block_size)
        counts = zeros.index_add(0, cells, counted).view(n, self.block_size)
        present = (counts.sum(1) > 0).sum()
        losses = torch.zeros(n, device=weighted.device).index_add(0, sequence, weighted) * present
        return losses, hits, counts

    def row_weights(self, row_ce: torch.Tensor, blocks: Blocks, rows_index: torch.Tensor,
                    counted: torch.Tensor | None = None) -> torch.Tensor:
        """Weights [P] of the supervised rows (flat indices `rows_index` into the query rows; no gradient flows
        through them): the loss is sum_r w_r·CE_r, a mean over the batch's sequences of each sequence's own loss.
        `counted` [P]: 0 for padding entries (`Blocks.padded`), which weigh nothing."""
        counted = torch.ones_like(row_ce) if counted is None else counted
        sequence, num_sequences = self._sequences(blocks)
        row_sequence = sequence.flatten()[rows_index]
        if self.position_weighting == "decay":  # each sequence's decay-weighted mean CE
            decay = self.slot_decay(row_ce.device)
            return sequence_normalised_weights(decay[rows_index % self.block_size] * counted, row_sequence,
                                               num_sequences)
        # D-PACE: each sequence's sum of w_j·CE_j over its blocks, divided by its number of blocks (not by
        # the sum of the weights, which would cancel the credit the weights give a block).
        b, block = blocks.labels.shape[0], self.block_size
        supervised = blocks.labels != IGNORE_INDEX
        # padding entries repeat a real row's index: they write to one slot past the end, which is dropped
        target = torch.where(counted > 0, rows_index, supervised.numel())
        ce = row_ce.new_zeros(supervised.numel() + 1).index_copy(0, target, row_ce.detach())[:-1].view(b, -1, block)
        weights = dpace_block_weights(ce, supervised.view(b, -1, block), self.dpace_alpha)
        # Blocks per sequence; a padded anchor (sequence -1 in packed rows) counts for none.
        anchor_sequence = sequence.reshape(b, -1, block)[:, :, 0].clamp_min(0).flatten()
        anchors = torch.zeros(num_sequences, device=row_ce.device).index_add(
            0, anchor_sequence, blocks.valid.flatten().float())
        return per_sequence_mean(weights.flatten()[rows_index] * counted, row_sequence, anchors)

    @staticmethod
    def _sequences(blocks: Blocks) -> tuple[torch.Tensor, int]:
        """The sequence of each query row [b, N*B] (a row, or a packed chat) and the number of sequences."""
        b, q = blocks.labels.shape
        if blocks.sequence is None:
            return torch.arange(b, device=blocks.labels.device)[:, None].expand(b, q), b
        # Padded anchors (-1) carry no label, so their rows are never indexed with it.
        return blocks.sequence.repeat_interleave(blocks.block_size, dim=1), int(blocks.num_sequences or 0)
