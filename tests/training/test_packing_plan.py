"""Packed training's data side: per-chat stats, the packing plan and the packed collate, each against a
plain per-row computation."""

from __future__ import annotations

import json
import pathlib

import datasets
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from dflash_train.features.packed_rows import chat_layout, collate_packed
from dflash_train.objective.blocks import anchor_candidates, partition_candidates
from dflash_train.training.config import load_config
from dflash_train.training.data import TrainingSamples, epoch_order
from dflash_train.training.packing import (
    PackedStepPlan,
    chat_stats,
    derive_anchors_per_row,
    flat_chat_stats,
    pack_rows,
)


def random_rows(seed: int, count: int = 40) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        n = int(torch.randint(1, 30, (1,), generator=gen))
        rows.append((torch.rand(n, generator=gen) < 0.7).int().tolist())
    return rows


def brute_candidates(mask: list[int], max_length: int, partition: int | None) -> int:
    cut = torch.tensor(mask[:max_length], dtype=torch.bool)[None]
    found = anchor_candidates(cut) if partition is None else partition_candidates(cut, partition)
    return int(found.sum())


@pytest.mark.parametrize("partition", [None, 4])
def test_flat_stats_count_each_cut_rows_candidates(partition: int | None) -> None:
    rows = random_rows(0)
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
    flat = np.array([v for r in rows for v in r], dtype=np.int8)
    stats = flat_chat_stats(flat, offsets, max_length=17, partition_block=partition)
    assert stats.lengths.tolist() == [min(len(r), 17) for r in rows]
    assert stats.candidates.tolist() == [brute_candidates(r, 17, partition) for r in rows]
    assert stats.anchors(3).tolist() == [min(3, brute_candidates(r, 17, partition)) for r in rows]


def test_prepared_and_store_stats_match_their_rows(tmp_path: pathlib.Path) -> None:
    rows = random_rows(1, count=13)
    ids = [[7 + i for i in range(len(r))] for r in rows]
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int8"))})
    table = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": rows}, features=features)
    table.save_to_disk(str(tmp_path / "prepared"))
    (tmp_path / "prepared" / "dflash_data.json").write_text("{}")
    save_store(tmp_path / "store", ids, rows, rows_per_shard=5)
    expected = [brute_candidates(r, 20, None) for r in rows]
    for samples in (TrainingSamples(str(tmp_path / "prepared"), None, 20), TrainingSamples(None, str(tmp_path / "store"), 20)):
        stats = chat_stats(samples)
        assert stats.lengths.tolist() == [samples[i]["input_ids"].shape[0] for i in range(len(rows))]
        assert stats.candidates.tolist() == expected
    samples = TrainingSamples(str(tmp_path / "prepared"), None, 20)
    samples.store = samples.store.select([4, 0, 9])  # a selection keeps its own row order
    assert chat_stats(samples).candidates.tolist() == [expected[4], expected[0], expected[9]]


def save_store(path: pathlib.Path, ids: list[list[int]], masks: list[list[int]], rows_per_shard: int) -> None:
    path.mkdir()
    units = range(0, len(ids), rows_per_shard)
    for unit, start in enumerate(units):
        part = slice(start, start + rows_per_shard)
        lengths = [len(r) for r in ids[part]]
        save_file({"input_ids": torch.tensor([t for r in ids[part] for t in r], dtype=torch.int32),
                   "loss_mask": torch.tensor([m for r in masks[part] for m in r], dtype=torch.uint8),
                   "offsets": torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64),
                   "features": torch.zeros(sum(lengths), 4, dtype=torch.bfloat16)},
                  str(path / f"features-{unit:06d}.safetensors"))
    manifest = {"num_rows": len(ids), "rows_per_shard": rows_per_shard, "num_units": len(units), "dtype": "bf16"}
    (path / "manifest.json").write_text(json.dumps(manifest))


def reference_rows(order: list[int], lengths: list[int], anchors: list[int], window: int,
                   choices: int = 1) -> list[list[int]]:
    """The packing spelled out: a row scans the first `window` chats not yet placed, in order, weighs the first
    `choices` that fit what is left of it by |tokens / 64 - anchors / 20| once added, and takes the lowest
    (the earliest of equals), until a scan finds none."""
    left, rows = list(order), []
    while left:
        row, tokens, used = [left.pop(0)], 0, 0
        tokens, used = lengths[row[0]], anchors[row[0]]
        while left:
            fits = [c for c in left[:window] if tokens + lengths[c] <= 64 and used + anchors[c] <= 20][:choices]
            if not fits:
                break
            unevenness = [abs((tokens + lengths[c]) / 64 - (used + anchors[c]) / 20) for c in fits]
            taken = fits[unevenness.index(min(unevenness))]
            left.remove(taken)
            row.append(taken)
            tokens, used = tokens + lengths[taken], used + anchors[taken]
        rows.append(row)
    return rows


@pytest.mark.parametrize("choices", [1, 3, 16])
@pytest.mark.parametrize("window", [1, 4, 64])
def test_rows_take_the_most_even_of_the_first_chats_that_fit(window: int, choices: int) -> None:
    gen = torch.Generator().manual_seed(2)
    lengths = torch.randint(1, 40, (60,), generator=gen).tolist()
    anchors = torch.randint(0, 12, (60,), generator=gen).tolist()
    order = torch.randperm(60, generator=gen).tolist()
    rows = pack_rows(order, lengths, anchors, pack_tokens=64, anchors_per_row=20, window=window, choices=choices)
    assert rows == reference_rows(order, lengths, anchors, window, choices)
    assert sorted(c for row in rows for c in row) == sorted(order)  # every chat once
    placed = [c for row in rows for c in row]
    assert all(abs(placed.index(c) - order.index(c)) < window + 20 for c in order)  # order kept up to the window
    for row in rows:
        assert sum(lengths[c] for c in row) <= 64 and sum(anchors[c] for c in row) <= 20
    greedy = pack_rows(order, lengths, anchors, pack_tokens=64, anchors_per_row=20, window=1)
    assert len(rows) <= len(greedy)  # looking ahead never takes more rows here


def test_weighing_the_chats_fills_the_anchor_slots_without_slack() -> None:
    """At a capacity of exactly the data's anchors per token, first fit leaves more of both budgets empty
    than the balanced pick, which keeps rows as full as first fit does with an eighth more anchor slots."""
    rng = np.random.default_rng(0)
    answers = np.where(rng.random(6000) < 0.3, 512, np.clip(rng.lognormal(np.log(180), 0.9, 6000), 2, 512))
    lengths = np.minimum(np.clip(rng.lognormal(np.log(60), 0.8, 6000), 8, 1500) + answers, 2048).astype(int)
    anchors = np.minimum(np.maximum(answers - 16, 0), 64).astype(int)
    order = rng.permutation(6000).tolist()

    def fills(per_row: int, choices: int) -> tuple[float, float, float]:
        rows = pack_rows(order, lengths.tolist(), anchors.tolist(), 8192, per_row, choices=choices)[:-2]
        return (float(np.mean([lengths[r].sum() for r in rows])) / 8192,
                float(np.mean([anchors[r].sum() for r in rows])) / per_row, float(np.mean([len(r) for r in rows])))

    at_mean = derive_anchors_per_row(lengths, anchors, 8192)
    with_slack = -(-int(at_mean * 1.125) // 16) * 16
    balanced, first_fit, first_fit_slack = fills(at_mean, 16), fills(at_mean, 1), fills(with_slack, 1)
    assert min(balanced[:2]) > 0.97 and balanced[0] > first_fit[0] + 0.01 and balanced[1] > first_fit[1] + 0.01
    assert first_fit_slack[1] < 0.9  # slack's price: a tenth of the slots run through the drafter empty
    assert balanced[2] > 0.99 * first_fit_slack[2]  # as many chats a row, on fewer slots


def test_greedy_rows_are_the_epoch_order_cut_where_the_next_chat_does_not_fit() -> None:
    gen = torch.Generator().manual_seed(2)
    lengths = torch.randint(1, 40, (60,), generator=gen).tolist()
    anchors = torch.randint(0, 12, (60,), generator=gen).tolist()
    order = torch.randperm(60, generator=gen).tolist()
    rows = pack_rows(order, lengths, anchors, pack_tokens=64, anchors_per_row=20, window=1)
    assert [c for row in rows for c in row] == order  # every chat once, in the epoch's order
    for row, following in zip(rows, [*rows[1:], None], strict=True):
        tokens, used = sum(lengths[c] for c in row), sum(anchors[c] for c in row)
        assert tokens <= 64 and used <= 20
        if following is not None:  # a row closes only when the next chat does not fit
            assert tokens + lengths[following[0]] > 64 or used + anchors[following[0]] > 20


def make_plan(train: list[int], lengths: list[int], anchors: list[int], **sizes: int) -> PackedStepPlan:
    values = {"batch_size": 2, "num_processes": 1, "accumulation": 1, **sizes}
    return PackedStepPlan(train, lengths, anchors, pack_tokens=64, anchors_per_row=24, seed=3, **values)


def test_plan_is_a_pure_function_of_seed_and_epoch() -> None:
    gen = torch.Generator().manual_seed(4)
    train = sorted(torch.randperm(90, generator=gen)[:70].tolist())
    lengths = torch.randint(4, 33, (90,), generator=gen).tolist()
    anchors = torch.randint(0, 10, (90,), generator=gen).tolist()
    plan, again = make_plan(train, lengths, anchors), make_plan(train, lengths, anchors)
    epochs = [pack_rows(epoch_order(train, 3, e), lengths, anchors, 64, 24) for e in range(3)]
    steps = [len(rows) // 2 for rows in epochs]
    assert plan.total_steps(2.5) == steps[0] + steps[1] + int(0.5 * steps[2])
    expected = [rows[i * 2 : i * 2 + 2] for e, rows in enumerate(epochs) for i in range(steps[e])]
    for step in reversed(range(len(expected))):  # any access order: a resumed run starts anywhere
        assert list(plan.micro_batches(step, 0)) == [expected[step]]
    for step in range(len(expected)):
        assert list(again.micro_batches(step, 0)) == [expected[step]]
        assert plan.chats_seen(step) == sum(len(row) for batch in expected[:step] for row in batch)
    # Two processes take their rows of the same micro-batch; accumulation splits a step in order.
    split = make_plan(train, lengths, anchors, batch_size=1, num_processes=2)
    accumulated = make_plan(train, lengths, anchors, batch_size=1, accumulation=2)
    for step in range(len(expected)):
        assert [next(split.micro_batches(step, r))[0] for r in (0, 1)] == expected[step]
        assert [m[0] for m in accumulated.micro_batches(step, 0)] == expected[step]
    counted = plan.counted_chats(expected[0])
    assert counted == sum(1 for row in expected[0] for c in row if anchors[c] > 0)


def test_a_plan_too_small_for_one_step_is_an_error() -> None:
    plan = make_plan([0, 1], [40, 40], [1, 1], batch_size=4)
    with pytest.raises(ValueError, match="2 packed rows do not fill one step of 4 rows"):
        plan.total_steps(1.0)


def test_derived_anchor_capacity_follows_the_data() -> None:
    lengths, anchors = np.array([100, 300, 200]), np.array([30, 90, 60])  # 0.3 anchors per token
    per_row = derive_anchors_per_row(lengths, anchors, 1000)
    assert per_row % 16 == 0 and 300 <= per_row < 300 + 16  # the data's own ratio, rounded up
    assert derive_anchors_per_row(np.array([10, 1000]), np.array([0, 500]), 1000) >= 500  # the largest chat fits
    assert derive_anchors_per_row(np.array([10]), np.array([10]), 10) == 16  # never beyond one per token (rounded)


def test_collate_packed_restarts_positions_and_numbers_chats() -> None:
    gen = torch.Generator().manual_seed(5)
    sizes = [[5, 3], [7], []]
    rows = [[{"input_ids": torch.randint(0, 50, (n,), generator=gen), "loss_mask": torch.rand(n, generator=gen) < 0.5,
              "features": torch.randn(n, 6, generator=gen)} for n in row] for row in sizes]
    batch = collate_packed(rows[:2], pack_tokens=10, num_rows=3)  # the third row: all padding
    chat = 0
    for r, row in enumerate(rows):
        start = 0
        for sample in row:
            n = sample["input_ids"].shape[0]
            assert torch.equal(batch["input_ids"][r, start : start + n], sample["input_ids"])
            assert torch.equal(batch["loss_mask"][r, start : start + n], sample["loss_mask"])
            assert torch.equal(batch["features"][r, start : start + n], sample["features"])
            assert batch["position_ids"][r, start : start + n].tolist() == list(range(n))
            assert batch["sequence_ids"][r, start : start + n].tolist() == [chat] * n
            chat, start = chat + 1, start + n
        assert batch["position_ids"][r, start:].tolist() == list(range(10 - start))  # padding: its own run
        assert batch["sequence_ids"][r, start:].tolist() == [-1] * (10 - start)
        assert not batch["loss_mask"][r, start:].any() and not batch["features"][r, start:].any()
    assert chat_layout(batch) == [(0, 0, 5), (0, 5, 3), (1, 0, 7)]
    unpacked = {"attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])}
    assert chat_layout(unpacked) == [(0, 0, 2), (1, 0, 3)]
    with pytest.raises(ValueError, match="more than pack_tokens=6"):
        collate_packed(rows[:1], pack_tokens=6, num_rows=1)


def test_packing_options_are_validated() -> None:
    base = ["data.prepared=x", "data.max_length=128"]
    assert load_config(None, [*base, "data.pack_tokens=256"]).data.pack_tokens == 256
    with pytest.raises(ValueError, match="pack_tokens=64 must be >= data.max_length=128"):
        load_config(None, [*base, "data.pack_tokens=64"])
    with pytest.raises(ValueError, match="anchors_per_row applies to packed rows only"):
        load_config(None, [*base, "training.anchors_per_row=64"])
    with pytest.raises(ValueError, match="pad_to_multiple does not apply"):
        load_config(None, [*base, "data.pack_tokens=256", "data.pad_to_multiple=64"])


def test_a_chat_larger_than_a_row_gets_a_row_alone() -> None:
    rows = pack_rows([0, 1, 2], [10, 100, 10], [1, 1, 1], pack_tokens=64, anchors_per_row=20)
    assert rows == [[0, 2], [1]]
    assert pack_rows([1, 0], [10, 100], [1, 1], pack_tokens=64, anchors_per_row=20) == [[1], [0]]


def test_packing_the_next_epoch_does_not_hold_up_reading_this_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader thread packs epoch 1 (held up here until the main thread has read epoch 0's steps): the main
    thread's reads of the plan go on meanwhile, and both then see the rows of an uninterrupted plan."""
    import threading

    from dflash_train.training import packing

    gen = torch.Generator().manual_seed(4)
    train = list(range(60))
    lengths = torch.randint(4, 33, (60,), generator=gen).tolist()
    anchors = torch.randint(0, 10, (60,), generator=gen).tolist()
    plan, reference = make_plan(train, lengths, anchors), make_plan(train, lengths, anchors)
    first_epoch = plan.steps_in_epoch(0)
    read, real_pack, held_up = threading.Event(), packing.pack_rows, []

    def slow_pack(*args: object, **kwargs: object) -> list[list[int]]:
        if not read.wait(timeout=5):  # the main thread never got to read epoch 0 meanwhile
            held_up.append(True)
        return real_pack(*args, **kwargs)

    monkeypatch.setattr(packing, "pack_rows", slow_pack)
    loader = threading.Thread(target=lambda: plan.step_rows(first_epoch))  # the first step of epoch 1
    loader.start()
    rows = [plan.step_rows(step) for step in range(first_epoch)]  # epoch 0, while epoch 1 is being packed
    read.set()
    loader.join(timeout=30)
    monkeypatch.setattr(packing, "pack_rows", real_pack)
    assert not loader.is_alive() and not held_up
    assert rows == [reference.step_rows(step) for step in range(first_epoch)]
    assert plan.step_rows(first_epoch) == reference.step_rows(first_epoch)
    assert plan.chats_seen(first_epoch + 1) == reference.chats_seen(first_epoch + 1)
