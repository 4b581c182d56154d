"""CUDA-only checks: the flex-attention BlockMask path equals the dense path (run with `make test-gpu`)."""

from __future__ import annotations

import pytest
import torch

from dflash_train.models import DFlashDraftModel
from dflash_train.objective import DFlashObjective
from tests.helpers.tiny_drafts import frozen_embed_and_head, tiny_draft

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

Result = tuple[torch.Tensor, list[torch.Tensor]]


def loss_and_grads(draft: DFlashDraftModel, kind: str, tile: int, dtype: torch.dtype, seq_len: int) -> Result:
    """The objective's loss and the drafter's gradients on one fixed random batch (two rows, row 1 with few
    anchors so that some blocks are padding)."""
    embed, head = frozen_embed_and_head(draft.config)
    embed, head = embed.cuda(), head.cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    input_ids = torch.randint(0, 50, (2, seq_len), device="cuda", generator=gen)
    loss_mask = torch.rand(2, seq_len, device="cuda", generator=gen) < 0.85
    loss_mask[1, : seq_len - 40] = False
    features = torch.randn(2, seq_len, draft.config.num_context_features * draft.config.hidden_size,
                           device="cuda", generator=gen)
    objective = DFlashObjective(block_size=16, mask_token_id=60, num_anchors=24, mask_kind=kind, flex_tile=tile)
    blocks = objective.make_blocks(input_ids, loss_mask, torch.Generator(device="cuda").manual_seed(1))
    draft.zero_grad()
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        out = objective(draft, embed, head, input_ids, loss_mask, features, blocks=blocks)
    out.loss.backward()
    return out.loss.detach(), [p.grad.clone() for p in draft.parameters()]


def assert_same(flex: Result, dense: Result, dtype: torch.dtype) -> None:
    tol = dict(atol=1e-4, rtol=1e-3) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(flex[0], dense[0], **tol)
    for flex_grad, dense_grad in zip(flex[1], dense[1], strict=True):
        scale = dense_grad.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(flex_grad / scale, dense_grad / scale, **tol)


@pytest.mark.parametrize(("dtype", "tile"), [(torch.float32, 128), (torch.bfloat16, 128), (torch.bfloat16, 64)])
def test_flex_objective_equals_dense_objective(dtype: torch.dtype, tile: int) -> None:
    """At the default 128-token tiles and at training.flex_tile=64 (the kernel's own tiles made to fit)."""
    draft = tiny_draft(block_size=16, hidden_size=128, head_dim=32, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=256, num_target_layers=12).cuda()
    assert_same(loss_and_grads(draft, "flex", tile, dtype, 300), loss_and_grads(draft, "dense", tile, dtype, 300), dtype)


@pytest.mark.parametrize("tile", [128, 64])
def test_compiled_layers_with_flex_tiles_equal_dense(tile: int) -> None:
    """As training runs them (training.compile: every decoder layer compiled, flex attention traced into the
    layer's graph) at the SmolLM2 drafter's head width 64 and grouped heads 9/3, over several tiles a row."""
    draft = tiny_draft(block_size=16, hidden_size=576, head_dim=64, num_attention_heads=9, num_key_value_heads=3,
                       intermediate_size=1536, num_target_layers=12).cuda()
    dense = loss_and_grads(draft, "dense", tile, torch.bfloat16, 1100)
    draft.compile_layers()
    assert_same(loss_and_grads(draft, "flex", tile, torch.bfloat16, 1100), dense, torch.bfloat16)
