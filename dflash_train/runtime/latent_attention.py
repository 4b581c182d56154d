"""Multi-head latent attention (DeepSeek-V3, Kimi, Moonlight) on decode and verify steps, with the value and key
up-projections absorbed: the cached latent is never expanded into every head's keys and values.

Why: the runtime caches what the layer caches, its compressed latent c [S, r] and RoPE key part k_rot [S, ρ] per
slot, one head each (`cache_layout.py`). The model's own forward then expands every cached slot through kv_b_proj
into H heads of keys and values before attending, at every step: about 2·r·H·(d_nope + d_v) FLOPs a slot, for
the whole static cache, so a step of 16 tokens costs in proportion to the cache's length, not to its tokens.
The up-projection is linear, so it can move to the few query tokens instead (as DeepSeek's own decode does):

    W_UK [H, d_nope, r], W_UV [H, d_v, r]: kv_b_proj's weight split by head into its key and value parts
    q_c     = q_nope · W_UK                          [b, H, T, r]    (the query in latent space)
    scores  = (q_c · cᵀ + q_rot · k_rotᵀ) · scale     [b, H, T, S]    (= q · kᵀ of the expanded keys)
    o_c     = softmax(scores) · c                      [b, H, T, r]
    out     = o_c · W_UVᵀ                             [b, H, T, d_v]  (= softmax · v of the expanded values)

Every head reads the same c and k_rot (one key-value head of width r + ρ), so the products are plain batched
matmuls over the slots, and nothing grows with H × S but the scores. The arithmetic equals the expanded form's
up to rounding; prompts (longer forwards) keep the model's own expanded path, where the expansion is shared by
many query tokens. The decoder layer around it is the model's: pre-norm, residual, its MLP or experts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek

from dflash_train.kernels.static_attention import mask_from_bounds


def has_latent_attention(layer: nn.Module) -> bool:
    return hasattr(getattr(layer, "self_attn", None), "kv_lora_rank")


def absorbable(layer: nn.Module) -> bool:
    """Whether `absorbed_attention` can read the layer's up-projection as a plain matrix: a latent-attention layer
    whose kv_b_proj is an unquantised `nn.Linear` (a quantised one, e.g. an FP8 checkpoint's, keeps the model's
    own expanded path, which calls the module)."""
    if not has_latent_attention(layer):
        return False
    projection = layer.self_attn.kv_b_proj
    return type(projection) is nn.Linear and projection.weight.dtype in (torch.float32, torch.bfloat16, torch.float16)


def latent_layer(layer: nn.Module, h: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                 mask: torch.Tensor, cache: Any) -> torch.Tensor:
    """The model's decoder layer with `absorbed_attention` in place of its attention module's forward.
    h [n, T, hidden] -> [n, T, hidden]."""
    h = h + absorbed_attention(layer.self_attn, layer.input_layernorm(h), position_embeddings, mask, cache)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def absorbed_attention(attn: nn.Module, x: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                       mask: torch.Tensor, cache: Any) -> torch.Tensor:
    """The attention module's output for x [n, T, hidden]: its latent and RoPE key written to `cache` at the
    tokens' positions, attention over the cache's visible slots in latent space (module docstring). `mask`:
    bool [n, 1, T, S] of the visible slots, or the Triton path's bounds [n, 2, T]."""
    n, t, _ = x.shape
    heads, d_nope, d_rope, d_v, rank = (attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim,
                                        attn.v_head_dim, attn.kv_lora_rank)
    q = attn.q_proj(x) if attn.q_lora_rank is None else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    q_nope, q_rot = q.view(n, t, heads, d_nope + d_rope).transpose(1, 2).split([d_nope, d_rope], dim=-1)
    latent, k_rot = attn.kv_a_proj_with_mqa(x).split([rank, d_rope], dim=-1)
    latent = attn.kv_a_layernorm(latent).view(n, 1, t, rank)  # one head, as the model caches it
    k_rot = k_rot.view(n, 1, t, d_rope)
    cos, sin = position_embeddings
    rotate = deepseek.apply_rotary_pos_emb_interleave if attn.config.rope_interleave else deepseek.apply_rotary_pos_emb
    q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)
    cached, cached_rot = cache.update(latent, k_rot)  # [n, 1, S, r], [n, 1, S, ρ]
    up = attn.kv_b_proj.weight.view(heads, d_nope + d_v, rank)  # [H, d_nope + d_v, r]
    q_latent = by_head(q_nope) @ up[:, :d_nope]  # [H, n·T, d_nope] @ [H, d_nope, r] -> [H, n·T, r]
    q_latent, q_rot = heads_as_rows(q_latent.view(heads, n, t, rank)), heads_as_rows(q_rot.transpose(0, 1))
    cached, cached_rot = cached.squeeze(1), cached_rot.squeeze(1)  # [n, S, r], [n, S, ρ]
    scores = (q_latent @ cached.transpose(-1, -2) + q_rot @ cached_rot.transpose(-1, -2)).float() * attn.scaling
    visible = mask if mask.dtype == torch.bool else mask_from_bounds(mask, cached.shape[-2])
    scores = scores.view(n, heads, t, -1).masked_fill(~visible, float("-inf"))
    weights = scores.softmax(-1).to(cached.dtype).view(n, heads * t, -1)  # [n, H·T, S]
    out_latent = (weights @ cached).view(n, heads, t, rank)  # [n, H·T, S] @ [n, S, r]
    out = by_head(out_latent) @ up[:, d_nope:].transpose(-1, -2)  # [H, n·T, r] @ [H, r, d_v] -> [H, n·T, d_v]
    return attn.o_proj(out.view(heads, n, t, d_v).permute(1, 2, 0, 3).reshape(n, t, heads * d_v))


def by_head(x: torch.Tensor) -> torch.Tensor:
    """[n, H, T, d] -> [H, n·T, d]: the per-head weights multiply every row's tokens in one batched matmul over
    the heads (a broadcast over n would copy each head's weight n times first)."""
    n, heads, t, d = x.shape
    return x.transpose(0, 1).reshape(heads, n * t, d)


def heads_as_rows(x: torch.Tensor) -> torch.Tensor:
    """[H, n, T, d] -> [n, H·T, d]: every head reads the same cached latent, so the heads become rows of one
    query matrix per sequence (as multi-query attention does) and the cache is read once, never copied per head."""
    heads, n, t, d = x.shape
    return x.transpose(0, 1).reshape(n, heads * t, d)
