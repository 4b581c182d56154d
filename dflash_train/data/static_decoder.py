"""A static-KV-cache forward for Llama-family targets (Llama, Mistral, Qwen2, Qwen3, SmolLM2).

It reuses the target's own modules (projections, norms, MLPs, rotary embedding, lm_head) but owns the
cache and the mask, so every decode step has the same shapes and no host synchronisation: the step can
be captured once as a CUDA graph and replayed. Rows are left-padded to a common prompt length ``P``; the
cache holds ``L`` positions (prompt + new tokens), and position ``p`` of every row is written at step
``p - P`` with one ``index_copy_``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def supports_static_decoding(model: nn.Module, cache_len: int) -> bool:
    config = model.config
    window = getattr(config, "sliding_window", None)
    windowed = window is not None and getattr(config, "use_sliding_window", True) and cache_len > window
    return config.model_type in SUPPORTED_MODEL_TYPES and not windowed and hasattr(model, "model")


@dataclass
class StaticKV:
    keys: list[Tensor]  # per layer [B, kv_heads, L, head_dim]
    values: list[Tensor]
    key_valid: Tensor  # [B, L] bool: False at left padding


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class StaticDecoder:
    """``prefill`` then ``step`` over a :class:`StaticKV`; both return last-position logits ``[B, V]``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.body = model.model
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads

    def new_cache(self, batch: int, cache_len: int, device: torch.device, dtype: torch.dtype) -> StaticKV:
        shape = (batch, self.num_kv_heads, cache_len, self.head_dim)
        layers = len(self.body.layers)
        return StaticKV(
            [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)],
            [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)],
            torch.zeros(batch, cache_len, dtype=torch.bool, device=device),
        )

    @torch.no_grad()
    def prefill(self, cache: StaticKV, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """``input_ids``/``attention_mask`` ``[B, P]`` left-padded; fills cache positions ``0..P-1``."""
        prompt_len = input_ids.shape[1]
        real = attention_mask.bool()
        cache.key_valid.zero_()
        cache.key_valid[:, :prompt_len] = real
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, P]
        causal = torch.ones(prompt_len, prompt_len, dtype=torch.bool, device=input_ids.device).tril()
        # [B, 1, P, P]; a pad query sees itself only, so no row of the softmax is empty
        mask = (causal[None] & real[:, None, :]) | torch.eye(prompt_len, dtype=torch.bool, device=real.device)
        slots = torch.arange(prompt_len, device=input_ids.device)
        return self._forward(cache, input_ids, positions, slots, mask[:, None], prompt_len)

    @torch.no_grad()
    def step(self, cache: StaticKV, tokens: Tensor, positions: Tensor, slot: Tensor) -> Tensor:
        """``tokens``/``positions`` ``[B, 1]``, ``slot`` ``[1]``: the cache index written this step."""
        # Slots past ``slot`` are still invalid (prefill cleared them), so validity alone is the mask.
        cache.key_valid.index_fill_(1, slot, True)
        mask = cache.key_valid[:, None, None, :]  # [B, 1, 1, L]
        return self._forward(cache, tokens, positions, slot, mask, cache.key_valid.shape[1])

    def _forward(self, cache: StaticKV, ids: Tensor, positions: Tensor, slots: Tensor, mask: Tensor,
                 key_len: int) -> Tensor:
        hidden = self.body.embed_tokens(ids)  # [B, S, H]
        cos, sin = self.body.rotary_emb(hidden, positions)  # [B, S, head_dim]
        cos, sin = cos[:, None], sin[:, None]
        for i, layer in enumerate(self.body.layers):
            attn_in = layer.input_layernorm(hidden)
            hidden = hidden + self._attention(layer.self_attn, attn_in, cos, sin, cache, i, slots, mask, key_len)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        last = self.body.norm(hidden[:, -1])
        return self.model.lm_head(last).float()  # [B, V]

    def _attention(self, attn: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, cache: StaticKV, layer: int,
                   slots: Tensor, mask: Tensor, key_len: int) -> Tensor:
        batch, seq, _ = x.shape
        q = attn.q_proj(x).view(batch, seq, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, S, head_dim]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        cache.keys[layer].index_copy_(2, slots, k)
        cache.values[layer].index_copy_(2, slots, v)
        keys, values = cache.keys[layer][:, :, :key_len], cache.values[layer][:, :, :key_len]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=getattr(attn, "scaling", self.head_dim**-0.5),
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return attn.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))
