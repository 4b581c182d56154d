"""The training mask against a brute-force construction from its definition (docs/design.md §6.3)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask, flex_attention

from dflash_train.models.attention import attend
from dflash_train.objective import dense_mask, flex_mask, sample_anchors
from dflash_train.objective.masks import flex_mask_mod


def brute_force_mask(anchors: list[list[int]], valid: list[list[bool]], seq_len: int, block: int) -> torch.Tensor:
    batch, num = len(anchors), len(anchors[0])
    q_len, kv_len = num * block, seq_len + num * block
    mask = torch.zeros(batch, 1, q_len, kv_len, dtype=torch.bool)
    for b in range(batch):
        for q in range(q_len):
            j = q // block
            if not valid[b][j]:
                continue  # padded blocks see nothing
            for kv in range(kv_len):
                if kv < seq_len:
                    mask[b, 0, q, kv] = kv < anchors[b][j]  # strictly before the anchor
                else:
                    mask[b, 0, q, kv] = (kv - seq_len) // block == j  # own block, bidirectional
    return mask


def random_case(seed: int, seq_len: int, num_anchors: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    loss_mask = torch.rand(2, seq_len, generator=gen) < 0.6
    loss_mask[1, : seq_len - 3] = False  # row 1: two candidates -> padded blocks
    loss_mask[1, -3:] = True
    loss_mask[0, -3:] = True  # anchors near the end -> blocks run past the sequence
    return sample_anchors(loss_mask, num_anchors, gen)


@pytest.mark.parametrize("seed,seq_len,num_anchors,block", [(0, 23, 6, 4), (1, 17, 9, 5), (2, 40, 3, 16)])
def test_dense_mask_matches_brute_force(seed: int, seq_len: int, num_anchors: int, block: int) -> None:
    anchors, valid = random_case(seed, seq_len, num_anchors, block)
    assert (~valid).any(), "the case must include padded blocks"
    expected = brute_force_mask(anchors.tolist(), valid.tolist(), seq_len, block)
    assert torch.equal(dense_mask(anchors, valid, seq_len, block), expected)


@pytest.mark.parametrize("seed,seq_len,num_anchors,block", [(0, 23, 6, 4), (3, 30, 8, 16)])
def test_flex_predicate_matches_brute_force(seed: int, seq_len: int, num_anchors: int, block: int) -> None:
    anchors, valid = random_case(seed, seq_len, num_anchors, block)
    mod = flex_mask_mod(anchors, valid, seq_len, block)
    got = create_mask(mod, 2, None, num_anchors * block, seq_len + num_anchors * block, device="cpu")
    expected = brute_force_mask(anchors.tolist(), valid.tolist(), seq_len, block)
    assert torch.equal(got.bool(), expected)


def test_flex_attention_equals_dense_attention() -> None:
    seq_len, num_anchors, block = 70, 9, 16  # not multiples of flex's 128-row tiles
    anchors, valid = random_case(5, seq_len, num_anchors, block)
    gen = torch.Generator().manual_seed(0)
    q_len, kv_len = num_anchors * block, seq_len + num_anchors * block
    q = torch.randn(2, 4, q_len, 8, generator=gen)
    k = torch.randn(2, 2, kv_len, 8, generator=gen)
    v = torch.randn(2, 2, kv_len, 8, generator=gen)
    dense = attend(q, k, v, dense_mask(anchors, valid, seq_len, block))
    block_mask = flex_mask(anchors, valid, seq_len, block)
    flex = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)
    padded_rows = (~valid).repeat_interleave(block, dim=1)
    assert dense.transpose(1, 2)[padded_rows].abs().max() == 0, "padded blocks must output zeros"


def test_dense_attention_has_no_nan_gradient_from_padded_blocks() -> None:
    anchors = torch.tensor([[3, 9, 20]])
    valid = torch.tensor([[True, True, False]])
    mask = dense_mask(anchors, valid, 12, 4)
    q = torch.randn(1, 2, 12, 8, requires_grad=True)
    k = torch.randn(1, 2, 24, 8, requires_grad=True)
    v = torch.randn(1, 2, 24, 8, requires_grad=True)
    attend(q, k, v, mask).sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert q.grad[:, :, 8:].abs().max() == 0
