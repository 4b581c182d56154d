"""CUDA-only checks: the flex-attention BlockMask path equals the dense path (run with `make test-gpu`)."""

from __future__ import annotations

import pytest
import torch

from dflash_train.objective import DFlashObjective
from tests.helpers.tiny_drafts import frozen_embed_and_head, tiny_draft

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize(("dtype", "tile"), [(torch.float32, 128), (torch.bfloat16, 128), (torch.bfloat16, 64)])
def test_flex_objective_equals_dense_objective(dtype: torch.dtype, tile: int) -> None:
    """At the default 128-token tiles and at training.flex_tile=64 (the kernel's own tiles made to fit)."""
    draft = tiny_draft(block_size=16, hidden_size=128, head_dim=32, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=256, num_target_layers=12).cuda()
    embed, head = frozen_embed_and_head(draft.config)
    embed, head = embed.cuda(), head.cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    seq_len = 300
    input_ids = torch.randint(0, 50, (2, seq_len), device="cuda", generator=gen)
    loss_mask = torch.rand(2, seq_len, device="cuda", generator=gen) < 0.85
    loss_mask[1, : seq_len - 40] = False  # few anchors in row 1: padded blocks
    features = torch.randn(2, seq_len, 2 * 128, device="cuda", generator=gen)
    results = {}
    for kind in ("dense", "flex"):
        objective = DFlashObjective(block_size=16, mask_token_id=60, num_anchors=24, mask_kind=kind, flex_tile=tile)
        blocks = objective.make_blocks(input_ids, loss_mask, torch.Generator(device="cuda").manual_seed(1))
        draft.zero_grad()
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            out = objective(draft, embed, head, input_ids, loss_mask, features, blocks=blocks)
        out.loss.backward()
        results[kind] = (out.loss.detach(), [p.grad.clone() for p in draft.parameters()])
    tol = dict(atol=1e-4, rtol=1e-3) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(results["flex"][0], results["dense"][0], **tol)
    for flex_grad, dense_grad in zip(results["flex"][1], results["dense"][1], strict=True):
        scale = dense_grad.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(flex_grad / scale, dense_grad / scale, **tol)
