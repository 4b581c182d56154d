"""The attention function the static target's layers call over its cache: the models' own layers through
transformers' attention interface (registered as `ATTENTION_NAME`), the fused layers directly. SDPA under a
boolean mask, the split-key kernel of `dflash_train.kernels.static_attention` given each query's visible
slots, or the PyTorch reference for what SDPA has not (gpt-oss's sinks, Gemma-2's soft-capped scores); when
each runs is in `static_target.py`'s module docstring.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface

from dflash_train.kernels.static_attention import mask_from_bounds, static_attention_triton

ATTENTION_NAME = "dflash_static"

# Keyword arguments layers hand the attention function beyond those it reads: each layer's sliding window is in
# its mask (built per layer as the model's own forward builds its masks), the others describe the call. Any other
# one is refused rather than ignored (a new transformers whose layers ask for more fails loudly).
HANDLED_ELSEWHERE = frozenset({"sliding_window", "position_ids", "use_cache", "cache_position"})


def static_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    prefetch: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query [b, heads, T, D], key/value [b, kv_heads, S, D], mask [b, 1, T, S] bool -> ([b, T, heads, D], None).

    An integer mask is the Triton path's bounds [b, 2, T] (first and last visible slot of each query); there a
    `prefetch` weight (the fused layers' o_proj, `StaticTarget(prefetch_weights=True)`) is asked of L2 meanwhile,
    and the fused layers' `counters` let a plan that merges in its split kernel do so. The module's `sinks`
    [heads] (gpt-oss; `s_aux` where its own layer passes them), where it has them, join the softmax on either
    path. `softcap` (Gemma-2) caps the scores
    with cap * tanh(score / cap) before the mask, as the model's eager attention does; the kernel has no cap, so
    such a layer takes the PyTorch path, its mask made from the bounds."""
    _check_arguments(kwargs)
    b, heads, t, d = query.shape
    scale = scaling if scaling is not None else d ** -0.5
    sinks = s_aux if s_aux is not None else getattr(module, "sinks", None)  # the HF layer's, or the fused one's
    if attention_mask.dtype != torch.bool:
        if softcap is None:
            return static_attention_triton(query, key, value, attention_mask, scale, prefetch, counters,
                                           sinks=sinks), None
        attention_mask = mask_from_bounds(attention_mask, key.shape[2])
    kv_heads, keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    # Query head i uses KV head i // groups: fold the group into the query axis instead of repeating K/V.
    q = query.reshape(b, kv_heads, groups * t, d)
    mask = attention_mask[:, :, None].expand(b, 1, groups, t, keys).reshape(b, 1, groups * t, keys)
    if sinks is not None or softcap is not None:
        out = _attention_reference(q, key, value, mask, scale, t, sinks=sinks, softcap=softcap)
    else:
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)  # [b, kv, g*T, Dv]
    return out.reshape(b, heads, t, value.shape[-1]).transpose(1, 2), None


def _check_arguments(kwargs: dict[str, Any]) -> None:
    # the handled ones' values are never read: under torch.compile a read would specialise the layer's code on
    # them (a sliding layer's window, say) and compile it again for each
    unknown = sorted(name for name in kwargs if name not in HANDLED_ELSEWHERE and kwargs[name] is not None)
    if unknown:
        raise ValueError(f"the static runtime's attention does not implement {', '.join(unknown)}")


def _attention_reference(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float,
                         t: int, sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention as the models' own eager functions compute it, with what SDPA has not: gpt-oss's sinks (one more
    logit per head that no value goes with) and Gemma-2's soft-capped scores. q [b, kv, g*T, D] grouped as above,
    sinks [heads] -> [b, kv, g*T, D]."""
    b, kv_heads, rows, _ = q.shape
    logits = (q @ key.transpose(-1, -2)).float() * scale  # [b, kv, g*T, S]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return logits.softmax(-1).to(value.dtype) @ value
    sink = sinks.float().reshape(kv_heads, -1, 1, 1).expand(kv_heads, rows // t, t, 1).reshape(1, kv_heads, rows, 1)
    weights = torch.cat([logits, sink.expand(b, -1, -1, -1)], dim=-1).softmax(-1)[..., :-1]
    return weights.to(value.dtype) @ value


def register_attention() -> None:
    AttentionInterface.register(ATTENTION_NAME, static_attention)
