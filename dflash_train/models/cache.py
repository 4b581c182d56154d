"""Static KV cache of the drafter's context: projected K/V of committed tokens, per draft layer.

Context K/V are computed once per committed token (`DFlashDraftModel.extend_context`) and reused by
every later draft cycle; `crop` rolls the cache back to any committed length.
"""

from __future__ import annotations

import torch

from dflash_train.models.config import DFlashConfig


class DraftKVCache:
    def __init__(
        self,
        config: DFlashConfig,
        batch_size: int,
        max_length: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (config.num_hidden_layers, batch_size, config.num_key_value_heads, max_length, config.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [L, b, kv_heads, max_len, D]
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_length = max_length
        self.length = 0

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [b, kv_heads, T, D] of `layer` at positions [length, length + T)."""
        end = self.length + k.shape[2]
        if end > self.max_length:
            raise ValueError(f"draft cache is full ({self.max_length} positions); raise max_length")
        self.keys[layer, :, :, self.length : end] = k
        self.values[layer, :, :, self.length : end] = v

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed context K/V of `layer`, each [b, kv_heads, length, D]."""
        return self.keys[layer, :, :, : self.length], self.values[layer, :, :, : self.length]

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a draft cache of length {self.length} to {length}")
        self.length = length
