"""Building blocks of the drafter, written as a diff over Hugging Face's Qwen3 decoder layer.

Same as Qwen3: RMSNorm (computed in fp32), per-head `q_norm`/`k_norm`, rotate-half RoPE, SwiGLU MLP.
Different (marked `# DFlash:`): keys and values also come from the projected target context, and
attention goes through `attend`, which takes the DFlash mask (dense or flex) instead of a causal one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dflash_train.models.attention import AttentionMask, attend
from dflash_train.models.config import DRAFTER_ROPE_TYPES, DFlashConfig, rope_type_of


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                     max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(RoPE inverse frequencies [head_dim / 2] in fp32, the factor cos and sin are scaled by).

    The scaled types come from transformers' own rope functions, so the drafter rotates exactly as a
    Hugging Face model with the same settings does; YaRN's factor (its attention temperature) is not 1."""
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
        return inv_freq.float(), 1.0
    if rope_type not in DRAFTER_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported by the drafter; use one of "
                         f"{', '.join(DRAFTER_ROPE_TYPES)}")
    params = {key: value for key, value in (scaling or {}).items() if key != "type"}
    params["rope_type"] = rope_type
    # rope_theta and rope_scaling: the arguments transformers 4.x reads, and 5.x turns into rope_parameters
    config = Qwen3Config(hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim, rope_theta=theta,
                         rope_scaling=params, max_position_embeddings=max_position_embeddings)
    with torch.device("cpu"):  # also when the model is built on the meta device, to be loaded into
        inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        inv_freq, self.attention_factor = rope_frequencies(config.head_dim, config.rope_theta, config.rope_scaling,
                                                           config.max_position_embeddings)
        inv_freq = inv_freq.to(torch.empty(0).device)  # computed on the CPU; kept where the model is being built
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._exact_inv_freq = inv_freq

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # `.to(bfloat16)` would round the frequencies (angle error ~1 rad by position 1000): moves
        # follow the module, dtype casts don't.
        super()._apply(fn, recurse)
        self.inv_freq = self._exact_inv_freq.to(self.inv_freq.device)
        return self

    @torch.no_grad()
    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [b, T] -> (cos, sin), each [b, T, head_dim]."""
        freqs = positions.float()[..., None] * self.inv_freq.float()
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, T, D]; cos/sin [b, T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class MLP(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(d, eps=config.rms_norm_eps)

    def _split_heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, heads, self.head_dim).transpose(1, 2)  # [b, heads, T, D]

    def key_values(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_norm + RoPE) and values of rows x [b, T, H] -> each [b, kv_heads, T, D]."""
        k = self.k_norm(self._split_heads(self.k_proj(x), self.num_kv_heads))
        v = self._split_heads(self.v_proj(x), self.num_kv_heads)
        # fp32 norm weights promote k to fp32 under autocast; attention runs in the projections' dtype.
        return apply_rope(k, cos, sin).to(v.dtype), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        mask: AttentionMask,
    ) -> torch.Tensor:
        """x: normed block rows [b, Q, H]; context_k/v [b, kv_heads, C, D] -> [b, Q, H]."""
        k, v = self.key_values(x, cos, sin)
        q = apply_rope(self.q_norm(self._split_heads(self.q_proj(x), self.num_heads)), cos, sin).to(v.dtype)
        # DFlash: keys/values are [context ; block]; queries come only from the block.
        k = torch.cat([context_k, k], dim=2)  # [b, kv_heads, C + Q, D]
        v = torch.cat([context_v, v], dim=2)
        out = attend(q, k, v, mask)  # [b, heads, Q, D]
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


@dataclass
class ContextRows:
    """Fused target features of the context tokens [b, C, H] with their RoPE tables. A layer given these
    projects them to its context K/V inside its own forward: sharded training (FSDP2, ZeRO-3) gathers a
    layer's weights only around that forward, so the projection must not happen outside it."""

    rows: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


ContextKV = tuple[torch.Tensor, torch.Tensor]  # cached context keys and values, each [b, kv_heads, C, D]


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context: ContextRows | ContextKV,
        mask: AttentionMask,
    ) -> torch.Tensor:
        """Block rows h [b, Q, H] attend to the context (rows to project, or cached K/V) and to the block."""
        if isinstance(context, ContextRows):
            context = self.self_attn.key_values(context.rows, context.cos, context.sin)
        # DFlash: only block rows flow through the layer; context rows enter as K/V alone.
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, *context, mask)
        return h + self.mlp(self.post_attention_layernorm(h))
