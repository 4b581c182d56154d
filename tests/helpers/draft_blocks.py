"""A drafter's blocks through `StaticDrafter` on the Triton kernels or its own forward, as the decode loop runs
them: shared by the drafter-layer tests and the attention kernel's runtime tests."""

from __future__ import annotations

import torch

from dflash_train.runtime import fused_layer
from dflash_train.runtime.static_draft import StaticDrafter
from tests.helpers.decoding import make_draft
from tests.helpers.kernels import DEVICE
from tests.helpers.tiny_models import make_tiny_target


def blocks_through(attention: str, fused_products: bool = False, skinny_shapes: fused_layer.Shapes = frozenset(),
                   ) -> tuple[list[torch.Tensor], StaticDrafter]:
    """Context from random features at 12 positions, then three blocks of 4 at per-row starts, with the
    context written after each block as the engine does after a verify (over the block's slots)."""
    target = make_tiny_target("llama", num_layers=5, seed=3)
    draft = make_draft(target, block_size=4, seed=5).to(DEVICE)
    drafter = StaticDrafter(draft, batch_size=2, block_size=4, max_length=32, kernels="triton", attention=attention,
                            fused_products=fused_products, skinny_shapes=skinny_shapes)
    gen = torch.Generator().manual_seed(4)
    features = torch.randn(2, 12, draft.fc.in_features, generator=gen).to(DEVICE)
    drafter.write_context(features, torch.arange(12, device=DEVICE).expand(2, 12))
    hidden = []
    for start in ([6, 12], [8, 13], [9, 17]):
        start_t = torch.tensor(start, device=DEVICE)
        positions = start_t[:, None] + torch.arange(4, device=DEVICE)
        embeds = torch.randn(2, 4, draft.config.hidden_size, generator=gen).to(DEVICE)
        hidden.append(drafter.hidden(embeds, positions, start_t))
        verified = torch.randn(2, 4, draft.fc.in_features, generator=gen).to(DEVICE)
        drafter.write_context(verified, positions)  # overwrites the block's slots, as after a verify
    return hidden, drafter
