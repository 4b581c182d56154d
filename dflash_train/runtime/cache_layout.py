"""What the static runtime keeps per row for a target (`static_target.py`), known from its config and modules
alone: a KV cache for each attention layer (multi-head latent attention's compressed latent and RoPE key where
the layer caches those), state rings for each linear-attention, Mamba-2 or convolution layer
(`linear_attention.py`), each layer's sliding window, and the memory check before allocating them. `inspect`
sizes a row's caches from the same layout the runner allocates by."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash_train.runtime.linear_attention import LinearStates, is_linear_layer, token_mixer
from dflash_train.target import TargetModel

MEMORY_HEADROOM = 0.9  # share of the free device memory the caches may take


def check_memory(needed: int, device: torch.device, shape: tuple[int, ...]) -> None:
    """A clear error before allocating caches that cannot fit, instead of an out-of-memory traceback."""
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if needed > MEMORY_HEADROOM * free:
        rows, _, positions, _ = shape
        raise ValueError(f"the caches of {rows} rows x {positions} positions (KV cache and linear-attention states) "
                         f"need {needed / 2**30:.1f} GiB, {free / 2**30:.1f} GiB are free: lower the batch size or the "
                         "prompt and answer lengths")


@dataclass(frozen=True)
class CacheLayout:
    """What the runtime keeps per row for a target: a KV cache of `cache_heads` x (`key_dim`, `value_dim`) per
    position for each layer in `cached`, and state rings (`linear_attention.py`) for each layer in `ring_kept`."""

    cache_heads: int
    key_dim: int
    value_dim: int
    same_head_dims: bool  # of the keys and values the attention reads (MLA expands its cache to other widths)
    cached: list[bool]
    ring_kept: list[bool]

    def bytes_per_row(self, target: TargetModel, positions: int, step_tokens: int) -> int:
        """One row's cache bytes: the KV caches at `positions`, and the rings for steps of `step_tokens`."""
        kv = sum(self.cached) * self.cache_heads * positions * (self.key_dim + self.value_dim) * target.dtype.itemsize
        rings = sum(LinearStates.bytes_for(token_mixer(layer), 1, step_tokens, target.dtype)
                    for layer, kept in zip(target.decoder_layers, self.ring_kept, strict=True) if kept)
        return kv + rings


def cache_layout(target: TargetModel) -> CacheLayout:
    """The runtime's caches for this target (`CacheLayout`), known from its config and modules alone."""
    config, layers = target.config.get_text_config(), target.decoder_layers
    attn = next(module for layer in layers if (module := attention_module(layer)) is not None)
    cached = [attention_module(layer) is not None for layer in layers]
    ring_kept = [is_linear_layer(config, index) for index in range(len(layers))]
    if hasattr(attn, "kv_lora_rank"):  # multi-head latent attention (DeepSeek-V3): the layer caches its latent
        # and its RoPE key part, one head each, and expands them into every head's keys and values itself
        return CacheLayout(1, attn.kv_lora_rank, attn.qk_rope_head_dim, attn.qk_head_dim == attn.v_head_dim,
                           cached, ring_kept)
    return CacheLayout(config.num_key_value_heads, attn.head_dim, attn.head_dim, True, cached, ring_kept)


def attention_module(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's attention module, or None (a Mamba, linear-attention, convolution, MLP or experts block):
    `self_attn`, or Nemotron-H's `mixer` in its attention blocks."""
    if hasattr(layer, "self_attn"):
        return layer.self_attn
    return layer.mixer if getattr(layer, "block_type", None) == "full_attention" else None


def sliding_window(config: Any, index: int) -> int | None:
    """Layer `index`'s sliding window as the model's forward builds its masks: by the config's layer types where
    it has them (a "sliding_attention" layer gets the config's window), else the config's window for every layer
    (Mistral, Phi-3). Not the attention module's attribute: EXAONE-4's full layers keep one they do not use."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return getattr(config, "sliding_window", None)
    return config.sliding_window if layer_types[index] == "sliding_attention" else None
