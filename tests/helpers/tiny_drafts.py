"""Tiny random drafters and a stand-in frozen embedding/head for fast CPU tests."""

from __future__ import annotations

import torch
from torch import nn

from dflash_train.models import DFlashConfig, DFlashDraftModel


def tiny_config(**overrides: object) -> DFlashConfig:
    values: dict[str, object] = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=61,
        num_target_layers=8,
        mask_token_id=60,
        block_size=4,
        rope_theta=10000.0,
    )
    values.update(overrides)
    return DFlashConfig(**values)  # type: ignore[arg-type]


def tiny_draft(seed: int = 0, **overrides: object) -> DFlashDraftModel:
    torch.manual_seed(seed)
    return DFlashDraftModel(tiny_config(**overrides))


def frozen_embed_and_head(config: DFlashConfig, seed: int = 1) -> tuple[nn.Embedding, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    embed = nn.Embedding(config.vocab_size, config.hidden_size)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(embed.weight.shape, generator=gen))
    embed.requires_grad_(False)
    head = torch.randn(config.vocab_size, config.hidden_size, generator=gen) * 0.5
    return embed, head
