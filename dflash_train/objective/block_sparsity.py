"""The tile structure of the training mask, computed from the anchors instead of by evaluating the mask.

Flex attention needs, for every tile of 128 queries, the list of 128-key tiles that are partly visible
(the mask function is applied inside them) and those that are wholly visible (it is skipped).
`create_block_mask` finds them by evaluating the mask function at every (query, key) pair: compiled,
that costs minutes of compilation on the first step; eagerly, it materialises [b, Q, K] intermediates
(tens of GB for packed rows). Here the structure is known in closed form: query row r sees one
interval of context keys `[context_start_r, context_end_r)` and the keys of its own block, so whether a
tile pair is touched or covered is a comparison of interval ends, [b, Q, key tiles] at most.

A tile pair is only ever called "full" when every one of its queries sees every one of its keys; tiles
at the ragged end of either axis are always partial, which is safe (the mask function decides there).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask

TILE = 128  # flex attention's default block size, in queries and in keys
QUERY_TILES_PER_CHUNK = 64  # bounds the [b, chunk rows, key tiles] intermediates


def interval_tiles(
    starts: torch.Tensor, ends: torch.Tensor, num_keys: int, tile: int = TILE
) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows with visible key intervals [starts, ends) ([b, rows], any number per row along a trailing
    axis [b, rows, I]): (touched, covered) [b, rows, key tiles] — some / every key of the tile visible."""
    if starts.dim() == 2:
        starts, ends = starts[..., None], ends[..., None]
    key_tiles = -(-num_keys // tile)
    tile_start = torch.arange(key_tiles, device=starts.device) * tile
    tile_end = (tile_start + tile).clamp(max=num_keys)
    s, e = starts[..., None], ends[..., None]  # [b, rows, I, 1]
    touched = (torch.maximum(s, tile_start) < torch.minimum(e, tile_end)).any(dim=2)
    whole_tile = (tile_end - tile_start) == tile  # a ragged last tile is never called covered
    covered = ((s <= tile_start) & (e >= tile_end)).any(dim=2) & whole_tile
    return touched, covered


def tile_lists(
    starts: torch.Tensor, ends: torch.Tensor, num_keys: int, tile: int = TILE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query tile: (partial, full) [b, query tiles, key tiles] bool, from per-row intervals."""
    b, rows = starts.shape[:2]
    query_tiles = -(-rows // tile)
    partial, full = [], []
    for first in range(0, query_tiles, QUERY_TILES_PER_CHUNK):
        last = min(first + QUERY_TILES_PER_CHUNK, query_tiles)
        r0, r1 = first * tile, min(last * tile, rows)
        touched, covered = interval_tiles(starts[:, r0:r1], ends[:, r0:r1], num_keys, tile)
        pad = (last - first) * tile - (r1 - r0)  # rows past the end: touch nothing, cover nothing
        if pad:
            touched = torch.nn.functional.pad(touched, (0, 0, 0, pad), value=False)
            covered = torch.nn.functional.pad(covered, (0, 0, 0, pad), value=False)
        touched = touched.view(b, last - first, tile, -1).any(dim=2)
        covered = covered.view(b, last - first, tile, -1).all(dim=2)
        full.append(covered)
        partial.append(touched & ~covered)
    return torch.cat(partial, dim=1), torch.cat(full, dim=1)


def _as_lists(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, Qt, Kt] bool -> (counts [b, 1, Qt], indices [b, 1, Qt, Kt]) with the selected tiles first."""
    counts = tiles.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[:, None].contiguous(), order[:, None].contiguous()


def block_mask_from_intervals(
    starts: torch.Tensor, ends: torch.Tensor, num_keys: int, mask_mod: Any, tile: int = TILE
) -> Any:
    """A flex-attention BlockMask whose rows see (a subset, decided by `mask_mod`, of) the key intervals
    [starts, ends) — [b, Q] or [b, Q, I] — and nothing outside them."""
    partial, full = tile_lists(starts, ends, num_keys, tile)
    kv_num, kv_indices = _as_lists(partial)
    full_num, full_indices = _as_lists(full)
    return BlockMask.from_kv_blocks(kv_num, kv_indices, full_num, full_indices, BLOCK_SIZE=tile,
                                    mask_mod=mask_mod, seq_lengths=(starts.shape[1], num_keys))


def training_intervals(
    anchors: torch.Tensor, valid: torch.Tensor, context_start: torch.Tensor, context_len: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row of the training layout (blocks.py): its context interval [chat start, anchor) and
    its own block's keys, as [b, N*B, 2] starts and ends; padded anchors see nothing."""
    num_blocks = anchors.shape[1]
    block_of_row = torch.arange(num_blocks * block_size, device=anchors.device) // block_size
    anchor, ok = anchors[:, block_of_row], valid[:, block_of_row]
    start = context_start[:, block_of_row]
    own_block = context_len + block_of_row * block_size  # [Q]
    zero = torch.zeros_like(anchor)
    starts = torch.stack([torch.where(ok, start, zero), torch.where(ok, own_block.expand_as(anchor), zero)], -1)
    ends = torch.stack([torch.where(ok, anchor, zero), torch.where(ok, own_block + block_size, zero)], -1)
    return starts, ends


def chat_starts(context_sequence: torch.Tensor) -> torch.Tensor:
    """[b, S] packed chat ids -> [b, S] index of the first token of each token's chat."""
    positions = torch.arange(context_sequence.shape[1], device=context_sequence.device).expand_as(context_sequence)
    begins = torch.ones_like(context_sequence, dtype=torch.bool)
    begins[:, 1:] = context_sequence[:, 1:] != context_sequence[:, :-1]
    return torch.where(begins, positions, torch.zeros_like(positions)).cummax(dim=1).values
