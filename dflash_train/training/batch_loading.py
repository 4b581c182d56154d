"""A step's micro-batches laid out on the host: which chats, padded to which shape, with the anchors of each
chat seeded and their blocks built and pinned before the step needs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dflash_train.features.packed_rows import chat_layout, collate_packed
from dflash_train.objective import Blocks
from dflash_train.training.config import TrainConfig
from dflash_train.training.data import collate
from dflash_train.training.step_graph import padded_blocks

HOST_ONLY = ("chats", "blocks")  # CPU batch entries that stay on the host (or travel on their own)


def anchor_seed(seed: int, step: int, sample: int, repeat: int = 0) -> int:
    """One seed per (run, step, sample): anchors are re-drawn every step, reproducibly. `repeat` counts the
    sample's earlier copies in the step (source weights above 1 may draw a chat twice): each copy gets anchors
    of its own."""
    return (seed * 1_000_003 + step * 7_919 + sample * 104_729 + repeat * 1_299_709) % (2**62)


def anchor_seeds(seed: int, step: int, samples: Sequence[int]) -> list[int]:
    """`anchor_seed` of each sample of a step's micro-batch, in order, copies counted."""
    copies: dict[int, int] = {}
    seeds = []
    for sample in samples:
        seeds.append(anchor_seed(seed, step, sample, copies.get(sample, 0)))
        copies[sample] = copies.get(sample, 0) + 1
    return seeds


def padding_multiple(config: TrainConfig, device: torch.device) -> int:
    """Compiled flex attention specialises on the sequence length: one padded shape means one compile (a new
    length per batch would recompile every step until dynamo gives up and runs flex attention eagerly)."""
    if config.data.pad_to_multiple is not None:
        return config.data.pad_to_multiple
    flex = device.type == "cuda" and config.training.attention in ("auto", "flex")
    return config.data.max_length if flex else 1


class BatchLoadingMixin:
    """The Trainer's loading: `_load_step` runs in `Trainer.fit`'s loader thread while the previous step
    computes. Relies on the Trainer's `config`, `accelerator`, `samples`, `packed`, `plan`, `train_ids`,
    `train_weights`, `pad_to`, `objective` (it builds the blocks) and `step_graph` (a captured step reads
    blocks padded to fixed shapes)."""

    def _load(self, indices: list[int]) -> dict[str, torch.Tensor]:
        batch = collate([self.samples[i] for i in indices], self.pad_to)
        if self.accelerator.device.type == "cuda":
            batch = {k: v.pin_memory() for k, v in batch.items()}  # lets the copy overlap compute
        return batch

    def _load_rows(self, rows: list[list[int]]) -> dict[str, torch.Tensor]:
        """A packed micro-batch: always batch_size rows (missing ones all padding), one static shape."""
        samples = [[self.samples[i] for i in row] for row in rows]
        batch = collate_packed(samples, self.config.data.pack_tokens, self.config.training.batch_size)
        if self.accelerator.device.type == "cuda":
            batch = {k: v.pin_memory() for k, v in batch.items()}
        return batch

    def _load_step(self, step: int) -> list[tuple[list[int], dict[str, Any]]]:
        """This rank's micro-batches of `step`: the chats' sample indices (in batch order) and the batch, its
        blocks built on the host (`_host_blocks`: this runs in the loader thread while the previous step computes)."""
        t = self.config.training
        rank = self.accelerator.process_index
        if self.packed is not None:
            loaded = [([i for row in rows for i in row], self._load_rows(rows))
                      for rows in self.packed.micro_batches(step, rank)]
        else:
            groups = self.plan.micro_batches(self.train_ids, t.seed, step, rank, self.train_weights)
            loaded = [(ids, self._load(ids)) for ids in groups]
        for indices, batch in loaded:
            blocks = self._host_blocks(batch, anchor_seeds(t.seed, step, indices))
            # a captured step reads blocks of fixed shapes: padded here, off the step's critical path
            batch["blocks"] = blocks if self.step_graph is None else self._pinned(padded_blocks(blocks))
        return loaded

    def _host_blocks(self, cpu_batch: dict[str, Any], seeds: list[int]) -> Blocks:
        """A CPU batch's blocks, built on the host: each chat's anchors come from a CPU generator seeded by its
        own seed (the same anchors on any device), and the dozen small ops per chat, and the count of the
        supervised rows, never reach the GPU's launch queue or make it wait."""
        return self._pinned(self.objective.seeded_blocks(cpu_batch, chat_layout(cpu_batch), seeds).with_supervised_rows())

    def _pinned(self, blocks: Blocks) -> Blocks:
        return blocks.pin_memory() if self.accelerator.device.type == "cuda" else blocks
