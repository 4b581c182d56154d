"""Anchors, block inputs and labels of the DFlash training objective.

Layout (one sequence of S tokens, N anchors, block size B):

    keys    = [ ctx_0 … ctx_{S-1} | block_0 (B rows) | block_1 | … | block_{N-1} ]
    queries = [ block_0 | block_1 | … | block_{N-1} ]                       (Q = N*B rows)

Block j holds `[x_{a_j}, MASK × (B-1)]` at positions `a_j … a_j+B-1`. Slot k (1..B-1) predicts
`x_{a_j+k}` — the token at its own position, not shifted. Slot 0 is the anchor and has no loss.
Anchors are sorted; padded anchors (a sequence with fewer than N candidates) have `valid = False`,
sit at position S (past every real token) and neither see nor count anything.

Packed rows hold several chats: anchors are then indices into the row, each block's positions are its
chat's own positions, and slot k is supervised only while a_j+k is still in the anchor's chat.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass
class Blocks:
    anchors: torch.Tensor  # [b, N] long, sorted; padded anchors = S
    valid: torch.Tensor  # [b, N] bool
    input_ids: torch.Tensor  # [b, N*B] long: anchor token then MASK
    positions: torch.Tensor  # [b, N*B] long: a_j + slot
    labels: torch.Tensor  # [b, N*B] long: target token or IGNORE_INDEX
    block_size: int
    # Packed rows only (None: one sequence per row): each anchor's chat within the batch (-1: padded
    # anchor), each context token's chat (-1: padding), and the number of chats.
    sequence: torch.Tensor | None = None  # [b, N] long
    context_sequence: torch.Tensor | None = None  # [b, S] long
    num_sequences: int | None = None
    # Flat indices [P] of the query rows with a label, in row-major order; None: found on demand.
    supervised_rows: torch.Tensor | None = None
    # Static shapes (`padded`): which of supervised_rows are real [P] (False: a padding entry, a copy of the
    # first index, which weighs nothing), and how many are.
    real_rows: torch.Tensor | None = None
    num_real_rows: int | None = None

    def supervised_index(self) -> torch.Tensor:
        """[P] flat indices into the [b, N*B] query rows of those with a label. Counting them on a GPU is a host
        sync: blocks built on the host carry them (`with_supervised_rows`), so the step never waits for it."""
        if self.supervised_rows is not None:
            return self.supervised_rows
        return (self.labels != IGNORE_INDEX).flatten().nonzero().squeeze(1)

    def with_supervised_rows(self) -> Blocks:
        return dataclasses.replace(self, supervised_rows=self.supervised_index())

    def padded(self, rows: int, sequences: int) -> Blocks:
        """The same blocks with `rows` supervised-row entries and room for `sequences` chats, whatever this
        batch holds, so that every step has the same shapes (a captured step replays them; objective.py gives
        the padding entries no weight, no hit and no count)."""
        index = self.supervised_index()
        count = index.numel()
        if count > rows:
            raise ValueError(f"{count} supervised rows do not fit a capacity of {rows}")
        filler = index[:1] if count else index.new_zeros(1)
        real = torch.arange(rows, device=index.device) < count
        chats = self.num_sequences if self.sequence is None else max(sequences, self.num_sequences or 0)
        return dataclasses.replace(self, supervised_rows=torch.cat([index, filler.expand(rows - count)]),
                                   real_rows=real, num_real_rows=count, num_sequences=chats)

    def to(self, device: torch.device, non_blocking: bool = False) -> Blocks:
        """The same blocks on `device` (from pinned host memory the copies do not block the host)."""
        return dataclasses.replace(self, **{name: value.to(device, non_blocking=non_blocking)
                                            for name, value in self._tensors().items()})

    def pin_memory(self) -> Blocks:
        return dataclasses.replace(self, **{name: value.pin_memory() for name, value in self._tensors().items()})

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                if isinstance(getattr(self, field.name), torch.Tensor)}

    @property
    def slots(self) -> torch.Tensor:
        """Slot index (0..B-1) of each query row, [N*B]."""
        return torch.arange(self.labels.shape[1], device=self.labels.device) % self.block_size

    @property
    def token_index(self) -> torch.Tensor:
        """[b, N*B]: index in the (packed) row of the token each query row stands for, a_j + slot."""
        return self.anchors.repeat_interleave(self.block_size, dim=1) + self.slots


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """[b, S] bool: position a is a candidate iff a and a+1 are both supervised."""
    candidates = torch.zeros_like(loss_mask, dtype=torch.bool)
    candidates[:, :-1] = loss_mask[:, :-1].bool() & loss_mask[:, 1:].bool()
    return candidates


def partition_candidates(loss_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """[b, S] bool: candidates on a fixed grid that cuts every supervised span into consecutive blocks
    of `block_size`, starting at the span's first token (the ablation of random anchors)."""
    supervised = loss_mask.bool()
    starts = supervised.clone()
    starts[:, 1:] &= ~supervised[:, :-1]
    positions = torch.arange(loss_mask.shape[1], device=loss_mask.device).expand_as(supervised)
    span_start = torch.where(starts, positions, torch.zeros_like(positions)).cummax(dim=1).values
    on_grid = (positions - span_start) % block_size == 0
    return anchor_candidates(loss_mask) & on_grid


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None,
    partition_block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw up to `num_anchors` candidate positions per row, without replacement, sorted.

    With `partition_block`, only the positions of a fixed block partition are candidates.
    Returns anchors [b, N] (padded entries = S) and valid [b, N]. Shapes are static (always N) so
    compiled attention never recompiles.
    """
    b, seq_len = loss_mask.shape
    if partition_block is None:
        candidates = anchor_candidates(loss_mask)
    else:
        candidates = partition_candidates(loss_mask, partition_block)
    # Random keys in (0, 1) for candidates, -1 for the rest: top-N keys = a uniform sample.
    keys = torch.rand(b, seq_len, generator=generator, device=loss_mask.device)
    keys = torch.where(candidates, keys, torch.full_like(keys, -1.0))
    take = min(num_anchors, seq_len)
    picked = keys.topk(take, dim=1).indices
    valid = candidates.gather(1, picked)
    anchors = torch.where(valid, picked, torch.full_like(picked, seq_len)).sort(dim=1).values
    valid = anchors < seq_len
    if take < num_anchors:  # pad to a static N
        pad = num_anchors - take
        anchors = torch.cat([anchors, anchors.new_full((b, pad), seq_len)], dim=1)
        valid = torch.cat([valid, valid.new_zeros((b, pad))], dim=1)
    return anchors, valid


def build_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    mask_token_id: int,
) -> Blocks:
    """Block inputs, positions and same-position labels for sorted anchors [b, N]."""
    b, seq_len = input_ids.shape
    slots = torch.arange(block_size, device=input_ids.device)
    positions = anchors[:, :, None] + slots  # [b, N, B]
    in_range = positions < seq_len
    clamped = positions.clamp(max=seq_len - 1)
    tokens = input_ids.gather(1, clamped.flatten(1)).view_as(positions)
    supervised = loss_mask.bool().gather(1, clamped.flatten(1)).view_as(positions)
    supervised = supervised & in_range & valid[:, :, None] & (slots > 0)
    labels = torch.where(supervised, tokens, torch.full_like(tokens, IGNORE_INDEX))
    block_ids = torch.full_like(tokens, mask_token_id)
    block_ids[:, :, 0] = tokens[:, :, 0]
    return Blocks(
        anchors=anchors,
        valid=valid,
        input_ids=block_ids.flatten(1),
        positions=positions.flatten(1),
        labels=labels.flatten(1),
        block_size=block_size,
    )


def sample_anchors_seeded(
    loss_mask: torch.Tensor, num_anchors: int, seeds: list[int], lengths: list[int] | None = None,
    partition_block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors drawn per sequence from its own seed over its own (unpadded) length: the same
    sequence at the same step gets the same anchors whatever rank, micro-batch or padding it lands
    in — which is what makes resumed and multi-process runs match a single uninterrupted one."""
    padded_len = loss_mask.shape[1]
    anchors, valid = [], []
    for row, seed in enumerate(seeds):
        length = padded_len if lengths is None else lengths[row]
        gen = torch.Generator(device=loss_mask.device).manual_seed(seed)
        a, v = sample_anchors(loss_mask[row : row + 1, :length], num_anchors, gen, partition_block)
        anchors.append(torch.where(v, a, torch.full_like(a, padded_len)))
        valid.append(v)
    return torch.cat(anchors), torch.cat(valid)


def sample_packed_anchors(
    loss_mask: torch.Tensor, chats: list[tuple[int, int, int]], seeds: list[int], num_anchors: int,
    capacity: int, partition_block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors of packed rows: each chat's (row, start, length) drawn from its own seed over its own tokens
    exactly as `sample_anchors_seeded` draws them unpacked, then moved to the chat's start in its row.

    Returns anchors [rows, capacity] (sorted; padded = the row length) and valid. The packing plan keeps a
    row's anchors within `capacity`; no host sync is needed to place them.
    """
    rows, length = loss_mask.shape
    per_row: list[list[torch.Tensor]] = [[] for _ in range(rows)]
    for (row, start, n), seed in zip(chats, seeds, strict=True):
        gen = torch.Generator(device=loss_mask.device).manual_seed(seed)
        a, v = sample_anchors(loss_mask[row : row + 1, start : start + n], num_anchors, gen, partition_block)
        per_row[row].append(torch.where(v, a + start, torch.full_like(a, length))[0])
    anchors = torch.full((rows, capacity), length, dtype=torch.long, device=loss_mask.device)
    for row, parts in enumerate(per_row):
        if parts:  # chats come in row order, so sorting only moves the padded entries to the end
            drawn = torch.cat(parts).sort().values[:capacity]
            anchors[row, : drawn.shape[0]] = drawn
    return anchors, anchors < length


def build_packed_blocks(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, position_ids: torch.Tensor, sequence_ids: torch.Tensor,
    anchors: torch.Tensor, valid: torch.Tensor, block_size: int, mask_token_id: int, num_sequences: int,
) -> Blocks:
    """`build_blocks` for packed rows: blocks at their chat's positions, labels cut at the chat's end."""
    blocks = build_blocks(input_ids, loss_mask, anchors, valid, block_size, mask_token_id)
    seq_len = input_ids.shape[1]
    at_anchor = anchors.clamp(max=seq_len - 1)
    anchor_sequence = torch.where(valid, sequence_ids.gather(1, at_anchor), torch.full_like(anchors, -1))
    token_sequence = sequence_ids.gather(1, blocks.token_index.clamp(max=seq_len - 1))
    same_chat = token_sequence == anchor_sequence.repeat_interleave(block_size, dim=1)
    labels = torch.where(same_chat, blocks.labels, torch.full_like(blocks.labels, IGNORE_INDEX))
    positions = (position_ids.gather(1, at_anchor)[:, :, None] + torch.arange(block_size, device=anchors.device))
    return dataclasses.replace(
        blocks, labels=labels, positions=positions.flatten(1), sequence=anchor_sequence,
        context_sequence=sequence_ids, num_sequences=num_sequences,
    )
