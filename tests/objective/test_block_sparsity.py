"""The closed-form tile lists of the training mask against flex attention's own evaluation of the mask."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from dflash_train.models.attention import SMALL_TILE_KERNEL_OPTIONS, attend, kernel_options
from dflash_train.objective.block_sparsity import chat_starts
from dflash_train.objective.masks import (
    dense_mask,
    flex_mask,
    flex_mask_mod,
    packed_dense_mask,
    packed_flex_mask,
    packed_flex_mask_mod,
)


def tiles(num: torch.Tensor, indices: torch.Tensor, key_tiles: int) -> torch.Tensor:
    """(counts [b, 1, Qt], indices [b, 1, Qt, Kt]) -> bool [b, Qt, Kt]."""
    b, _, qt = num.shape
    out = torch.zeros(b, qt, key_tiles, dtype=torch.bool)
    for r in range(b):
        for q in range(qt):
            out[r, q, indices[r, 0, q, : num[r, 0, q]].long()] = True
    return out


def tile_sets(block_mask: object, key_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    partial = tiles(block_mask.kv_num_blocks, block_mask.kv_indices, key_tiles)
    full = tiles(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, key_tiles)
    return partial, full


def random_anchors(seed: int, batch: int, seq_len: int, num: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    anchors = torch.stack([torch.randperm(seq_len - 1, generator=gen)[:num].sort().values for _ in range(batch)])
    valid = torch.rand(batch, num, generator=gen) < 0.8
    anchors = torch.where(valid, anchors, torch.full_like(anchors, seq_len)).sort(dim=1).values
    return anchors, anchors < seq_len


def check_against_reference(block_mask: object, mask_mod: object, batch: int, q_len: int, kv_len: int,
                            tile: int = 128) -> None:
    reference = create_block_mask(mask_mod, batch, None, q_len, kv_len, device="cpu", _compile=False, BLOCK_SIZE=tile)
    key_tiles = -(-kv_len // tile)
    got_partial, got_full = tile_sets(block_mask, key_tiles)
    ref_partial, ref_full = tile_sets(reference, key_tiles)
    assert torch.equal(got_partial | got_full, ref_partial | ref_full), "touched tiles differ"
    assert not (got_full & ~ref_full).any(), "a tile called full holds an invisible pair"
    assert got_full.any() or not ref_full.any(), "no full tile found where the mask has some"


@pytest.mark.parametrize(("seq_len", "num", "block"), [(300, 40, 16), (1000, 30, 16), (257, 37, 10), (600, 64, 8)])
def test_tiles_equal_those_of_the_evaluated_mask(seq_len: int, num: int, block: int) -> None:
    anchors, valid = random_anchors(seq_len, 3, seq_len, num)
    block_mask = flex_mask(anchors, valid, seq_len, block)
    check_against_reference(block_mask, flex_mask_mod(anchors, valid, seq_len, block), 3, num * block,
                            seq_len + num * block)


@pytest.mark.parametrize("tile", [64, 32])
def test_smaller_tiles_equal_those_of_the_evaluated_mask(tile: int) -> None:
    anchors, valid = random_anchors(5, 2, 700, 40)
    block_mask = flex_mask(anchors, valid, 700, 16, tile)
    assert tuple(block_mask.BLOCK_SIZE) == (tile, tile)
    check_against_reference(block_mask, flex_mask_mod(anchors, valid, 700, 16), 2, 40 * 16, 700 + 40 * 16, tile)


def packed_case(seed: int, chat_lengths: list[list[int]], row_len: int, num: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    sequence = torch.full((len(chat_lengths), row_len), -1)
    anchors, valid, owner = [], [], []
    chat = 0
    for r, lengths in enumerate(chat_lengths):
        start = 0
        for n in lengths:
            sequence[r, start : start + n] = chat
            start, chat = start + n, chat + 1
        candidates = torch.nonzero(sequence[r] >= 0).flatten()
        pick = candidates[torch.randperm(len(candidates), generator=gen)[:num]].sort().values
        ok = torch.ones(num, dtype=torch.bool)
        if len(pick) < num:
            ok[len(pick):] = False
            pick = torch.cat([pick, pick.new_full((num - len(pick),), row_len)])
        anchors.append(pick)
        valid.append(ok)
        owner.append(torch.where(ok, sequence[r, pick.clamp(max=row_len - 1)], torch.full_like(pick, -1)))
    return torch.stack(anchors), torch.stack(valid), torch.stack(owner), sequence


def test_packed_tiles_equal_those_of_the_evaluated_mask() -> None:
    anchors, valid, owner, sequence = packed_case(0, [[300, 200, 260], [700, 50]], 800, 48)
    block_mask = packed_flex_mask(anchors, valid, owner, sequence, 16)
    mod = packed_flex_mask_mod(anchors, valid, owner, sequence, 16)
    check_against_reference(block_mask, mod, 2, 48 * 16, 800 + 48 * 16)


def test_packed_tiles_of_64_equal_those_of_the_evaluated_mask() -> None:
    anchors, valid, owner, sequence = packed_case(2, [[300, 200, 260], [700, 50]], 800, 48)
    block_mask = packed_flex_mask(anchors, valid, owner, sequence, 16, 64)
    mod = packed_flex_mask_mod(anchors, valid, owner, sequence, 16)
    check_against_reference(block_mask, mod, 2, 48 * 16, 800 + 48 * 16, 64)
    assert kernel_options(block_mask) == SMALL_TILE_KERNEL_OPTIONS  # the kernel's tiles fit the mask's
    assert kernel_options(packed_flex_mask(anchors, valid, owner, sequence, 16)) is None


@pytest.mark.parametrize("tile", [128, 64])
def test_packed_flex_attention_over_many_tiles_equals_dense_attention(tile: int) -> None:
    anchors, valid, owner, sequence = packed_case(1, [[260, 140, 330], [400, 333]], 770, 40)
    gen = torch.Generator().manual_seed(0)
    q_len, kv_len = 40 * 16, 770 + 40 * 16
    q = torch.randn(2, 4, q_len, 8, generator=gen)
    k, v = torch.randn(2, 2, kv_len, 8, generator=gen), torch.randn(2, 2, kv_len, 8, generator=gen)
    dense = attend(q, k, v, packed_dense_mask(anchors, valid, owner, sequence, 16))
    mask = packed_flex_mask(anchors, valid, owner, sequence, 16, tile)
    flex = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


def test_flex_attention_over_many_tiles_equals_dense_attention() -> None:
    anchors, valid = random_anchors(7, 2, 900, 50)
    gen = torch.Generator().manual_seed(1)
    q_len, kv_len = 50 * 16, 900 + 50 * 16
    q = torch.randn(2, 4, q_len, 8, generator=gen)
    k, v = torch.randn(2, 2, kv_len, 8, generator=gen), torch.randn(2, 2, kv_len, 8, generator=gen)
    dense = attend(q, k, v, dense_mask(anchors, valid, 900, 16))
    flex = flex_attention(q, k, v, block_mask=flex_mask(anchors, valid, 900, 16), enable_gqa=True)
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


def test_chat_starts_by_brute_force() -> None:
    sequence = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [3, 3, 3, 3, 4, 4, 4, 4]])
    expected = [[0, 0, 0, 3, 3, 5, 6, 6], [0, 0, 0, 0, 4, 4, 4, 4]]
    assert chat_starts(sequence).tolist() == expected
