"""The DFlash training attention mask (see blocks.py for the key/query layout).

A query in block j sees context keys kv < a_j — strictly: the anchor's own target feature does not
exist yet at inference — and all B keys of its own block (bidirectional); nothing of other blocks.
Padded blocks see nothing. `dense_mask` is the CPU path and the reference; `flex_mask` builds the
same predicate as a sparse flex-attention `BlockMask` for the GPU.

Packed rows (several chats per row) add one condition: a query sees only context keys of its anchor's
chat (`packed_dense_mask`, `packed_flex_mask`; kv < a_j is then an index into the packed row).
"""

from __future__ import annotations

from typing import Any

import torch

from dflash_train.objective.block_sparsity import (
    TILE,
    block_mask_from_intervals,
    chat_starts,
    training_intervals,
)


def dense_mask(anchors: torch.Tensor, valid: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Bool mask [b, 1, N*B, S + N*B] (True = visible)."""
    num_queries = anchors.shape[1] * block_size
    device = anchors.device
    query_block = torch.arange(num_queries, device=device) // block_size  # [Q]
    query_anchor = anchors[:, query_block]  # [b, Q]
    query_valid = valid[:, query_block]
    kv = torch.arange(context_len + num_queries, device=device)
    is_context = kv < context_len
    sees_context = is_context & (kv[None, None, :] < query_anchor[:, :, None])
    kv_block = torch.div(kv - context_len, block_size, rounding_mode="floor")
    sees_block = ~is_context & (kv_block[None, :] == query_block[:, None])
    return (query_valid[:, :, None] & (sees_context | sees_block))[:, None]


def flex_mask(anchors: torch.Tensor, valid: torch.Tensor, context_len: int, block_size: int, tile: int = TILE) -> Any:
    """The same predicate as `dense_mask`, as a flex-attention BlockMask of `tile`-sized tiles (computed from
    the anchors, block_sparsity.py: no compilation, no [b, Q, K] intermediate)."""
    mask_mod = flex_mask_mod(anchors, valid, context_len, block_size)
    starts, ends = training_intervals(anchors, valid, torch.zeros_like(anchors), context_len, block_size)
    return block_mask_from_intervals(starts, ends, context_len + anchors.shape[1] * block_size, mask_mod, tile)


def flex_mask_mod(anchors: torch.Tensor, valid: torch.Tensor, context_len: int, block_size: int) -> Any:
    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        block = q_idx // block_size
        is_context = kv_idx < context_len
        sees_context = is_context & (kv_idx < anchors[b, block])
        sees_block = ~is_context & ((kv_idx - context_len) // block_size == block)
        return valid[b, block] & (sees_context | sees_block)

    return mask_mod


def packed_dense_mask(
    anchors: torch.Tensor, valid: torch.Tensor, anchor_sequence: torch.Tensor, context_sequence: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """`dense_mask` for packed rows: anchor_sequence [b, N] is each anchor's chat, context_sequence [b, S]
    each token's (-1: padding). Bool [b, 1, N*B, S + N*B]."""
    context_len = context_sequence.shape[1]
    mask = dense_mask(anchors, valid, context_len, block_size)
    query_block = torch.arange(anchors.shape[1] * block_size, device=anchors.device) // block_size
    same_chat = context_sequence[:, None, :] == anchor_sequence[:, query_block, None]  # [b, Q, S]
    mask[:, 0, :, :context_len] &= same_chat
    return mask


def packed_flex_mask(
    anchors: torch.Tensor, valid: torch.Tensor, anchor_sequence: torch.Tensor, context_sequence: torch.Tensor,
    block_size: int, tile: int = TILE,
) -> Any:
    """The same predicate as `packed_dense_mask`, as a flex-attention BlockMask of `tile`-sized tiles (tiles of
    other chats' context are skipped, so attention costs what each chat's own context costs)."""
    mask_mod = packed_flex_mask_mod(anchors, valid, anchor_sequence, context_sequence, block_size)
    context_len = context_sequence.shape[1]
    start = chat_starts(context_sequence).gather(1, anchors.clamp(max=context_len - 1))
    starts, ends = training_intervals(anchors, valid, start, context_len, block_size)
    return block_mask_from_intervals(starts, ends, context_len + anchors.shape[1] * block_size, mask_mod, tile)


def packed_flex_mask_mod(
    anchors: torch.Tensor, valid: torch.Tensor, anchor_sequence: torch.Tensor, context_sequence: torch.Tensor,
    block_size: int,
) -> Any:
    b, context_len = context_sequence.shape
    # Every key index must be readable: block keys get a chat id no anchor has.
    key_sequence = torch.cat([context_sequence, context_sequence.new_full((b, anchors.shape[1] * block_size), -2)], 1)
    unpacked = flex_mask_mod(anchors, valid, context_len, block_size)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        own_chat = (kv_idx >= context_len) | (key_sequence[b, kv_idx] == anchor_sequence[b, q_idx // block_size])
        return unpacked(b, h, q_idx, kv_idx) & own_chat

    return mask_mod
