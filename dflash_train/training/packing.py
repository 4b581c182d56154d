"""Packed training: several whole chats per row of exactly `pack_tokens` tokens.

Short chats right-padded to one static length waste most of a compiled micro-batch; packing fills rows
with whole chats instead and keeps one static shape. The packing of an epoch is a pure function of
(seed, epoch): chats are taken in the epoch's random order, each row filled from a small window ahead with
the chats that still fit and keep its tokens and anchor slots about equally full (`pack_rows`), so a resumed
run and a run on another number of processes see the same rows at the same step. A chat's anchor count is min(num_anchors, its anchor candidates), as unpacked.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import numpy as np
import pyarrow.compute as pc
import torch

from dflash_train.features.store import open_shard, shard_path
from dflash_train.objective.blocks import anchor_candidates
from dflash_train.training.data import epoch_order

# Anchor capacity over the data's mean anchors per token. No slack: the balanced pick below fills both budgets
# about equally, so a capacity at the mean closes rows on either about as often (docs/training.md, 'Packed rows').
ANCHOR_SLACK = 1.0
ANCHOR_MULTIPLE = 16
PACK_WINDOW = 64  # chats a row looks ahead to fill what the next chat in order would leave empty
PACK_CHOICES = 16  # of the window's chats that fit, the first this many are weighed against each other
# The rule's name, kept in checkpoints: a resumed run whose rows are packed otherwise says so.
PACK_RULE = f"balanced, first {PACK_CHOICES} fitting of {PACK_WINDOW}"


@dataclass(frozen=True)
class ChatStats:
    """Per dataset row: tokens after the cut to max_length, and anchor candidates among them."""

    lengths: np.ndarray
    candidates: np.ndarray

    def anchors(self, num_anchors: int) -> np.ndarray:
        return np.minimum(self.candidates, num_anchors)


def flat_chat_stats(
    loss_mask: np.ndarray, offsets: np.ndarray, max_length: int, partition_block: int | None = None
) -> ChatStats:
    """Stats of rows stored back to back: row r is loss_mask[offsets[r]:offsets[r+1]] (no Python loop
    over rows: a 150k-chat set is read in about a second)."""
    lengths = np.minimum(np.diff(offsets), max_length).astype(np.int64)
    starts = offsets[:-1].astype(np.int64)
    supervised = loss_mask.astype(bool)
    # The objective's own rule (`anchor_candidates`) over the rows back to back; a pair that crosses into the
    # next row, or past the cut, is outside [start, start + length - 1) and not counted.
    pair = np.zeros(supervised.shape[0] + 1, dtype=bool)
    pair[:-1] = anchor_candidates(torch.from_numpy(supervised)[None])[0].numpy()
    if partition_block is not None:
        pair[:-1] &= _on_partition_grid(supervised, starts, partition_block)
    total = np.concatenate([[0], np.cumsum(pair, dtype=np.int64)])
    last = np.maximum(starts + lengths - 1, starts)  # candidates lie in [start, start + length - 1)
    return ChatStats(lengths, total[last] - total[starts])


def _on_partition_grid(supervised: np.ndarray, starts: np.ndarray, block: int) -> np.ndarray:
    """Positions on the fixed block grid of their supervised span: `partition_candidates`'s grid over rows
    back to back, a span never continuing into the next row (tests/training/test_packing_plan.py checks
    the two agree row by row)."""
    index = np.arange(supervised.shape[0], dtype=np.int64)
    span_start = supervised.copy()
    span_start[1:] &= ~supervised[:-1]
    row_starts = starts[starts < supervised.shape[0]]  # a span never continues into the next row
    span_start[row_starts] = supervised[row_starts]
    latest = np.maximum.accumulate(np.where(span_start, index, 0))
    return (index - latest) % block == 0


def concat_stats(parts: Sequence[ChatStats]) -> ChatStats:
    if not parts:
        return ChatStats(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    return ChatStats(np.concatenate([p.lengths for p in parts]), np.concatenate([p.candidates for p in parts]))


def prepared_chat_stats(dataset: Any, max_length: int, partition_block: int | None = None) -> ChatStats:
    """Stats of a prepared `datasets.Dataset`, read from its Arrow column chunk by chunk."""
    parts = []
    for chunk in dataset.data.table.column("loss_mask").chunks:
        offsets = np.concatenate([[0], np.cumsum(pc.list_value_length(chunk).to_numpy(zero_copy_only=False))])
        values = chunk.flatten().to_numpy(zero_copy_only=False)
        parts.append(flat_chat_stats(values, offsets, max_length, partition_block))
    stats = concat_stats(parts)
    if dataset._indices is not None:  # a selection or shuffle of the stored table
        rows = dataset._indices.column(0).to_numpy()
        stats = ChatStats(stats.lengths[rows], stats.candidates[rows])
    return stats


def store_chat_stats(store: Any, max_length: int, partition_block: int | None = None) -> ChatStats:
    """Stats of an offline feature store, from each shard's loss mask and row offsets."""
    parts = []
    for unit in range(store.num_units):
        handle = open_shard(shard_path(store.path, unit))
        offsets = handle.get_tensor("offsets").numpy()
        mask = handle.get_tensor("loss_mask").numpy()
        parts.append(flat_chat_stats(mask, offsets, max_length, partition_block))
    return concat_stats(parts)


def chat_stats(samples: Any, partition_block: int | None = None) -> ChatStats:
    """Stats of every row of `TrainingSamples` (prepared data or a feature store)."""
    if samples.offline:
        return store_chat_stats(samples.store, samples.max_length, partition_block)
    return prepared_chat_stats(samples.store, samples.max_length, partition_block)


def derive_anchors_per_row(lengths: np.ndarray, anchors: np.ndarray, pack_tokens: int) -> int:
    """Anchor capacity of a row: the data's anchors per token times the row's tokens, with some slack, so
    that neither budget closes most rows early; never less than the largest chat's anchors."""
    ratio = float(anchors.sum()) / max(1, int(lengths.sum()))
    wanted = math.ceil(pack_tokens * ratio * ANCHOR_SLACK)
    ceiling = -(-pack_tokens // ANCHOR_MULTIPLE) * ANCHOR_MULTIPLE  # a row holds at most pack_tokens anchors
    wanted = max(min(wanted, ceiling), int(anchors.max(initial=1)))
    return -(-wanted // ANCHOR_MULTIPLE) * ANCHOR_MULTIPLE


def check_anchors_per_row(anchors_per_row: int, anchors: np.ndarray) -> None:
    largest = int(anchors.max(initial=0))
    if anchors_per_row < largest:
        raise ValueError(f"training.anchors_per_row={anchors_per_row} is below the {largest} anchors of the "
                         "largest chat; raise it or leave it unset (derived from the data)")


def pack_rows(
    order: Sequence[int], lengths: Sequence[int], anchors: Sequence[int], pack_tokens: int, anchors_per_row: int,
    window: int = PACK_WINDOW, choices: int = PACK_CHOICES,
) -> list[list[int]]:
    """Rows of whole chats, in order up to a window: a row takes, of the first `choices` among the next `window`
    unplaced chats whose tokens and anchors still fit, the one that leaves the row's two budgets the most
    evenly used (`balance`; the earliest on a tie), until none fits; then the next row starts.

    Why weigh them: a row's tokens pay for the target's pass and its anchor slots for the drafter's blocks, and
    an anchor slot left empty still runs through the drafter. Taking the first chat that fits fills the
    tokens and leaves the anchor slots to chance, so their capacity needs slack; steering each row towards the
    data's own anchors per token fills both. A chat moves ahead of at most `window - 1` others, so the epoch's
    random order is kept up to that. `choices=1` is first fit; `window=1` plain greedy (a row wastes about half
    a chat, on tokens or on anchors). A row starts with the earliest unplaced chat, so one too large for any
    row gets a row alone, at its place."""
    upcoming = iter(order)
    ahead = list(islice(upcoming, window))
    rows: list[list[int]] = []
    while ahead:
        row, tokens, used, pick = [], 0, 0, 0
        while pick is not None:
            chat = ahead.pop(pick)
            row.append(chat)
            tokens, used = tokens + lengths[chat], used + anchors[chat]
            ahead.extend(islice(upcoming, 1))
            fitting = islice((i for i, chat in enumerate(ahead)
                              if tokens + lengths[chat] <= pack_tokens and used + anchors[chat] <= anchors_per_row),
                             choices)
            pick = min(fitting, default=None,
                       key=lambda i: balance(tokens + lengths[ahead[i]], used + anchors[ahead[i]], pack_tokens,
                                             anchors_per_row))
        rows.append(row)
    return rows


def balance(tokens: int, anchors: int, pack_tokens: int, anchors_per_row: int) -> float:
    """How unevenly a row holding `tokens` and `anchors` uses its two budgets: 0 when both are the same share
    full."""
    return abs(tokens / pack_tokens - anchors / anchors_per_row)


@dataclass
class PackedStepPlan:
    """How packed rows map to optimizer steps: batch_size rows per micro-batch and process.

    Each epoch has its own number of steps (its rows // rows per step; leftover rows are dropped), so
    the step -> rows mapping never depends on the run's length and is extended lazily.
    """

    train: Sequence[int]
    lengths: list[int]
    anchors: list[int]
    pack_tokens: int
    anchors_per_row: int
    batch_size: int
    num_processes: int
    accumulation: int
    seed: int
    weights: Sequence[float] | None = None  # per chat of `train`: `data.source_weights` (`epoch_order`)
    _rows: dict[int, list[list[int]]] = field(default_factory=dict, repr=False)
    _steps: list[int] = field(default_factory=list, repr=False)
    _chats: list[np.ndarray] = field(default_factory=list, repr=False)  # per epoch: chats before each step
    # The loader thread packs the next step while the main thread reads the plan.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def rows_per_step(self) -> int:
        return self.batch_size * self.num_processes * self.accumulation

    def epoch_rows(self, epoch: int) -> list[list[int]]:
        """The epoch's rows, packed on first use. Packing a large set takes seconds (docs/benchmarks.md,
        `pack_fill`), so it runs outside the lock: the loader thread packs the next epoch while the main thread
        still reads this one's steps. Two threads that both pack an epoch get the same rows (a pure function of
        seed and epoch); the first is kept."""
        with self._lock:
            rows = self._rows.get(epoch)
        if rows is not None:
            return rows
        packed = pack_rows(epoch_order(self.train, self.seed, epoch, self.weights), self.lengths, self.anchors,
                           self.pack_tokens, self.anchors_per_row)
        with self._lock:
            if epoch not in self._rows and len(self._rows) >= 2:  # one epoch at a time (two around a boundary)
                self._rows.pop(next(iter(self._rows)))
            return self._rows.setdefault(epoch, packed)

    def steps_in_epoch(self, epoch: int) -> int:
        while True:
            with self._lock:
                if len(self._steps) > epoch:
                    return self._steps[epoch]
                upcoming = len(self._steps)
            rows = self.epoch_rows(upcoming)  # packed without the lock held
            if len(rows) < self.rows_per_step:
                raise ValueError(f"{len(rows)} packed rows do not fill one step of {self.rows_per_step} rows; "
                                 "lower training.batch_size, gradient_accumulation_steps or data.pack_tokens")
            steps = len(rows) // self.rows_per_step
            per_step = np.array([len(r) for r in rows[: steps * self.rows_per_step]]).reshape(steps, -1).sum(1)
            with self._lock:
                if len(self._steps) == upcoming:  # not appended by the other thread meanwhile
                    self._steps.append(steps)
                    self._chats.append(np.concatenate([[0], np.cumsum(per_step)]))

    def total_steps(self, epochs: float) -> int:
        whole = int(epochs)
        steps = sum(self.steps_in_epoch(e) for e in range(whole))
        if epochs > whole:
            steps += int((epochs - whole) * self.steps_in_epoch(whole))
        return max(1, steps)

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, step within the epoch) of a global step."""
        epoch = 0
        while step >= self.steps_in_epoch(epoch):
            step -= self.steps_in_epoch(epoch)
            epoch += 1
        return epoch, step

    def step_rows(self, step: int) -> list[list[int]]:
        epoch, within = self.locate(step)
        return self.epoch_rows(epoch)[within * self.rows_per_step : (within + 1) * self.rows_per_step]

    def micro_batches(self, step: int, rank: int) -> Iterator[list[list[int]]]:
        """This rank's micro-batches (rows of chat indices) of optimizer step `step`."""
        rows = self.step_rows(step)
        per_micro = self.batch_size * self.num_processes
        for micro in range(self.accumulation):
            group = rows[micro * per_micro : (micro + 1) * per_micro]
            yield group[rank * self.batch_size : (rank + 1) * self.batch_size]

    def counted_chats(self, rows: Sequence[Sequence[int]]) -> int:
        """Chats with at least one anchor: the ones the loss averages over."""
        return sum(1 for row in rows for chat in row if self.anchors[chat] > 0)

    def chats_seen(self, steps: int) -> int:
        """Chats trained on in the first `steps` optimizer steps."""
        epoch, within = self.locate(steps)
        return int(sum(self._chats[e][-1] for e in range(epoch)) + self._chats[epoch][within])

    def fill(self, rows: Sequence[Sequence[int]], num_rows: int | None = None) -> tuple[float, float]:
        """(real tokens / token capacity, anchors / anchor capacity) of `num_rows` rows holding `rows`."""
        num_rows = num_rows or len(rows)
        tokens = sum(self.lengths[c] for row in rows for c in row)
        anchors = sum(self.anchors[c] for row in rows for c in row)
        return tokens / (num_rows * self.pack_tokens), anchors / (num_rows * self.anchors_per_row)
