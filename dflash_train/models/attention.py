"""One attention entry point for the drafter: dense SDPA masks (CPU, tests) or flex `BlockMask` (GPU).

Mask convention: True = the query may see the key. A query row that sees no key at all (a padded
block) outputs zeros on both paths, as flex attention does, so it contributes nothing downstream.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from dflash_train.models.flex_backward_configs import fit_backward_configs_to_small_tiles

# A dense bool tensor [b, 1, Q, K], a flex-attention BlockMask, or None (every key visible).
AttentionMask = Any


def is_block_mask(mask: AttentionMask) -> bool:
    return type(mask).__name__ == "BlockMask"


# Flex attention's own kernel tiles must divide the mask's: for masks of 64-token tiles (training.flex_tile) the
# forward and both backward passes get tiles of at most 64 (its defaults on H100/H200 are up to 128).
SMALL_TILE_KERNEL_OPTIONS = {"BLOCK_M": 64, "BLOCK_N": 64, "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64,
                             "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32}


def kernel_options(mask: AttentionMask) -> dict[str, int] | None:
    """Flex kernel options a BlockMask's tile asks for: None at the default 128, the small tiles below it (and
    inductor's backward given a config they can apply to, models/flex_backward_configs.py)."""
    if min(mask.BLOCK_SIZE) >= 128:
        return None
    if not torch.compiler.is_compiling():  # inside a compiled layer the objective has made the fit already
        fit_backward_configs_to_small_tiles()
    return SMALL_TILE_KERNEL_OPTIONS


@functools.cache
def _compiled_flex_attention() -> Any:
    return torch.compile(flex_attention, dynamic=False)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """q [b, heads, Q, D], k/v [b, kv_heads, K, D] -> [b, heads, Q, D] (grouped-query aware)."""
    if is_block_mask(mask):
        options = kernel_options(mask) if q.is_cuda else None
        if q.is_cuda and not torch.compiler.is_compiling():
            return _compiled_flex_attention()(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=options)
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=options)
    k, v = k.to(q.dtype), v.to(q.dtype)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    # Rows with no visible key would give NaN under SDPA (and NaN * 0 poisons gradients), so they
    # attend everywhere and are zeroed afterwards.
    has_key = mask.any(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~has_key, enable_gqa=True)
    return out * has_key.to(out.dtype)
