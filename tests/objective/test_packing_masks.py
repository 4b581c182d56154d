"""Packed anchors, blocks and masks against brute-force constructions from their definitions."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask, flex_attention

from dflash_train.features.packed_rows import chat_layout, collate_packed
from dflash_train.models.attention import attend
from dflash_train.objective.blocks import (
    IGNORE_INDEX,
    build_packed_blocks,
    sample_anchors_seeded,
    sample_packed_anchors,
)
from dflash_train.objective.masks import packed_dense_mask, packed_flex_mask, packed_flex_mask_mod
from dflash_train.training.data import collate

MASK_ID = 99


def random_chats(seed: int, sizes: list[list[int]]) -> list[list[dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for row in sizes:
        chats = []
        for n in row:
            loss_mask = torch.rand(n, generator=gen) < 0.7
            loss_mask[-3:] = True  # anchors near a chat's end: blocks run into the next chat
            chats.append({"input_ids": torch.randint(0, 90, (n,), generator=gen), "loss_mask": loss_mask})
        rows.append(chats)
    return rows


def packed_case(seed: int, sizes: list[list[int]], pack: int, num_anchors: int, capacity: int, block: int) -> tuple:
    rows = random_chats(seed, sizes)
    batch = collate_packed(rows, pack, len(rows))
    chats = chat_layout(batch)
    seeds = [1000 * seed + i for i in range(len(chats))]
    anchors, valid = sample_packed_anchors(batch["loss_mask"], chats, seeds, num_anchors, capacity)
    return rows, batch, chats, seeds, anchors, valid


CASES = [  # seed, chats per row, pack_tokens, num_anchors, capacity, block
    (0, [[9, 6, 5], [12]], 24, 4, 12, 4),
    (1, [[7, 7], [5, 4, 6]], 20, 3, 8, 3),
    (2, [[30, 20], [25]], 64, 8, 16, 16),
]


def brute_force_mask(anchors: list[list[int]], valid: list[list[bool]], sequence_ids: list[list[int]],
                     block: int) -> torch.Tensor:
    batch, num, seq_len = len(anchors), len(anchors[0]), len(sequence_ids[0])
    mask = torch.zeros(batch, 1, num * block, seq_len + num * block, dtype=torch.bool)
    for b in range(batch):
        for q in range(num * block):
            j = q // block
            if not valid[b][j]:
                continue  # padded anchors see nothing
            chat = sequence_ids[b][anchors[b][j]]
            for kv in range(seq_len + num * block):
                if kv < seq_len:  # its own chat's context, strictly before the anchor
                    mask[b, 0, q, kv] = sequence_ids[b][kv] == chat and kv < anchors[b][j]
                else:
                    mask[b, 0, q, kv] = (kv - seq_len) // block == j
    return mask


def anchor_sequence(batch: dict[str, torch.Tensor], anchors: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    at = anchors.clamp(max=batch["sequence_ids"].shape[1] - 1)
    return torch.where(valid, batch["sequence_ids"].gather(1, at), torch.full_like(anchors, -1))


@pytest.mark.parametrize("case", CASES)
def test_packed_anchors_are_each_chats_unpacked_anchors_moved_into_the_row(case: tuple) -> None:
    rows, batch, chats, seeds, anchors, valid = packed_case(*case)
    flat = [chat for row in rows for chat in row]
    unpacked = collate(flat)
    lengths = unpacked["attention_mask"].sum(1).tolist()
    alone, alone_valid = sample_anchors_seeded(unpacked["loss_mask"], case[3], seeds, lengths)
    expected: list[list[int]] = [[] for _ in rows]
    for i, (row, start, _) in enumerate(chats):
        expected[row] += [a + start for a in alone[i][alone_valid[i]].tolist()]
    for row in range(len(rows)):
        got = anchors[row][valid[row]].tolist()
        assert got == expected[row] and len(got) <= case[4]
        assert (anchors[row][~valid[row]] == batch["input_ids"].shape[1]).all()  # padded anchors sit past the row


@pytest.mark.parametrize("case", CASES)
def test_packed_dense_and_flex_masks_match_brute_force(case: tuple) -> None:
    _, batch, _, _, anchors, valid = packed_case(*case)
    block = case[5]
    assert (~valid).any(), "the case must include padded anchors"
    expected = brute_force_mask(anchors.tolist(), valid.tolist(), batch["sequence_ids"].tolist(), block)
    sequence = anchor_sequence(batch, anchors, valid)
    assert torch.equal(packed_dense_mask(anchors, valid, sequence, batch["sequence_ids"], block), expected)
    mod = packed_flex_mask_mod(anchors, valid, sequence, batch["sequence_ids"], block)
    q_len, kv_len = expected.shape[2], expected.shape[3]
    got = create_mask(mod, anchors.shape[0], None, q_len, kv_len, device="cpu")
    assert torch.equal(got.bool(), expected)


def test_packed_flex_attention_equals_dense_attention() -> None:
    _, batch, _, _, anchors, valid = packed_case(3, [[40, 33], [50, 20]], 90, 9, 20, 16)
    sequence = anchor_sequence(batch, anchors, valid)
    gen = torch.Generator().manual_seed(0)
    q_len, kv_len = anchors.shape[1] * 16, 90 + anchors.shape[1] * 16
    q = torch.randn(2, 4, q_len, 8, generator=gen)
    k = torch.randn(2, 2, kv_len, 8, generator=gen)
    v = torch.randn(2, 2, kv_len, 8, generator=gen)
    dense = attend(q, k, v, packed_dense_mask(anchors, valid, sequence, batch["sequence_ids"], 16))
    block_mask = packed_flex_mask(anchors, valid, sequence, batch["sequence_ids"], 16)
    flex = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_packed_blocks_match_loops(case: tuple) -> None:
    _, batch, chats, _, anchors, valid = packed_case(*case)
    block = case[5]
    blocks = build_packed_blocks(batch["input_ids"], batch["loss_mask"], batch["position_ids"], batch["sequence_ids"],
                                 anchors, valid, block, MASK_ID, len(chats))
    ends = {i: start + n for i, (_, start, n) in enumerate(chats)}
    starts = {i: start for i, (_, start, _) in enumerate(chats)}
    ids, mask, seq = batch["input_ids"].tolist(), batch["loss_mask"].tolist(), batch["sequence_ids"].tolist()
    crossing = 0  # slots whose token is supervised but lies in the next chat
    for b in range(anchors.shape[0]):
        for j, a in enumerate(anchors[b].tolist()):
            chat = seq[b][a] if valid[b, j] else -1
            assert blocks.sequence[b, j] == chat
            for k in range(block):
                q = j * block + k
                if valid[b, j]:
                    assert blocks.positions[b, q] == a - starts[chat] + k  # the chat's own position
                    assert blocks.input_ids[b, q] == (ids[b][a] if k == 0 else MASK_ID)
                inside = valid[b, j] and k > 0 and a + k < ends[chat] and mask[b][a + k]
                assert blocks.labels[b, q] == (ids[b][a + k] if inside else IGNORE_INDEX)
                crossing += bool(valid[b, j] and k > 0 and ends[chat] <= a + k < len(ids[b]) and mask[b][a + k])
    assert crossing > 0, "the case must include blocks that run into the next chat"
    assert torch.equal(blocks.context_sequence, batch["sequence_ids"]) and blocks.num_sequences == len(chats)
