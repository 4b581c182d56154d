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

# A dense bool tensor [b, 1, Q, K], a flex-attention BlockMask, or None (every key visible).
AttentionMask = Any


def is_block_mask(mask: AttentionMask) -> bool:
    return type(mask).__name__ == "BlockMask"


@functools.cache
def _compiled_flex_attention() -> Any:
    return torch.compile(flex_attention, dynamic=False)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """q [b, heads, Q, D], k/v [b, kv_heads, K, D] -> [b, heads, Q, D] (grouped-query aware)."""
    if is_block_mask(mask):
        if q.is_cuda and not torch.compiler.is_compiling():
            return _compiled_flex_attention()(q, k, v, block_mask=mask, enable_gqa=True)
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    k, v = k.to(q.dtype), v.to(q.dtype)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    # Rows with no visible key would give NaN under SDPA (and NaN * 0 poisons gradients), so they
    # attend everywhere and are zeroed afterwards.
    has_key = mask.any(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~has_key, enable_gqa=True)
    return out * has_key.to(out.dtype)
