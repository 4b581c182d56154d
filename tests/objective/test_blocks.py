"""Anchor sampling, block inputs and same-position labels against plain Python loops."""

from __future__ import annotations

import torch

from dflash_train.objective import IGNORE_INDEX, build_blocks, sample_anchors


def test_anchors_are_sorted_unique_candidates() -> None:
    gen = torch.Generator().manual_seed(0)
    loss_mask = torch.rand(3, 50, generator=gen) < 0.7
    loss_mask[2] = False
    loss_mask[2, 10:14] = True  # exactly 3 candidates: 10, 11, 12
    anchors, valid = sample_anchors(loss_mask, 8, gen)
    assert anchors.shape == (3, 8) and valid.shape == (3, 8)
    for row in range(3):
        picked = anchors[row][valid[row]].tolist()
        assert picked == sorted(set(picked))
        for a in picked:
            assert loss_mask[row, a] and loss_mask[row, a + 1]
        assert (anchors[row][~valid[row]] == 50).all()
        num_candidates = int((loss_mask[row, :-1] & loss_mask[row, 1:]).sum())
        assert len(picked) == min(8, num_candidates)
    assert anchors[2][valid[2]].tolist() == [10, 11, 12]


def test_anchors_are_redrawn_and_cover_all_candidates() -> None:
    loss_mask = torch.ones(1, 40, dtype=torch.bool)
    gen = torch.Generator().manual_seed(0)
    seen = torch.zeros(40)
    for _ in range(200):
        anchors, valid = sample_anchors(loss_mask, 5, gen)
        seen[anchors[valid]] += 1
    assert (seen[:39] > 0).all() and seen[39] == 0  # the last position has no successor
    # roughly uniform: each candidate expected 200*5/39 ~ 25.6 times
    assert seen[:39].min() > 8 and seen[:39].max() < 50


def test_block_inputs_and_labels_match_loops() -> None:
    gen = torch.Generator().manual_seed(1)
    seq_len, block, mask_id = 21, 5, 99
    input_ids = torch.randint(0, 90, (2, seq_len), generator=gen)
    loss_mask = torch.rand(2, seq_len, generator=gen) < 0.75
    loss_mask[:, -4:] = True
    anchors, valid = sample_anchors(loss_mask, 7, gen)
    blocks = build_blocks(input_ids, loss_mask, anchors, valid, block, mask_id)
    for b in range(2):
        for j in range(7):
            a, ok = int(anchors[b, j]), bool(valid[b, j])
            for k in range(block):
                row = j * block + k
                assert blocks.positions[b, row] == a + k
                if ok:
                    expected_in = input_ids[b, a] if k == 0 else mask_id
                    assert blocks.input_ids[b, row] == expected_in
                p = a + k
                supervised = ok and k > 0 and p < seq_len and bool(loss_mask[b, p])
                expected_label = int(input_ids[b, p]) if supervised else IGNORE_INDEX
                assert blocks.labels[b, row] == expected_label, (b, j, k)
    assert (blocks.labels[:, ::block] == IGNORE_INDEX).all(), "slot 0 never has a loss"


def brute_force_partition(mask: list[int], block_size: int) -> set[int]:
    """Start of each supervised span, then every block_size-th position while a and a+1 are supervised."""
    grid, start = set(), None
    for a, bit in enumerate(mask):
        if bit and (a == 0 or not mask[a - 1]):
            start = a
        if bit and a + 1 < len(mask) and mask[a + 1] and (a - start) % block_size == 0:
            grid.add(a)
    return grid


def test_partition_anchors_sit_on_each_spans_block_grid() -> None:
    from dflash_train.objective.blocks import partition_candidates

    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        mask = (torch.rand(2, 57, generator=g) < 0.8).long()
        mask[:, :5] = 0
        for block_size in (3, 4, 16):
            grid = partition_candidates(mask, block_size)
            for row in range(2):
                expected = brute_force_partition(mask[row].tolist(), block_size)
                assert set(grid[row].nonzero().flatten().tolist()) == expected
                anchors, valid = sample_anchors(mask[row : row + 1], 64, g, partition_block=block_size)
                assert set(anchors[valid].tolist()) == expected  # N exceeds the grid: every grid point
            few, few_valid = sample_anchors(mask, 2, g, partition_block=block_size)
            for row in range(2):
                assert set(few[row][few_valid[row]].tolist()) <= brute_force_partition(mask[row].tolist(), block_size)
