"""The packing-fill benchmark: its simulated chats, and a small run whose rows agree with what it reports."""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest

from benchmarks import pack_fill as bench


@pytest.mark.parametrize("shape", list(bench.SHAPES))
def test_simulated_chats_have_their_shape(shape: str) -> None:
    lengths, anchors = bench.simulated_chats(shape, 5000)
    assert int(lengths.max()) <= 2048 and int(lengths.min()) > 8
    assert int(anchors.max()) <= bench.NUM_ANCHORS and int(anchors.min()) >= 0
    assert bool((anchors <= lengths).all())


def test_a_small_run_reports_each_rule_and_writes_its_figures(tmp_path: pathlib.Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_BENCH_RESULTS", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["pack_fill", "--chats", "4000"])
    bench.main()
    results = json.loads((tmp_path / "pack_fill.json").read_text())["results"]
    assert len(results) == len(bench.SHAPES) * len(bench.RULES)
    by = {(r["shape"], r["rule"]): r for r in results}
    for shape in bench.SHAPES:
        trainer, slack = by[shape, "balanced, no slack (trainer)"], by[shape, "first fit, slack 1.125"]
        assert trainer["chats_per_slot_vs_trainer"] == 1.0
        assert slack["anchor_slots"] > trainer["anchor_slots"] and slack["anchor_fill"] < trainer["anchor_fill"]
        assert slack["chats_per_slot_vs_trainer"] < 0.95  # the slack's empty slots
        # the ratio is the rows' own chats per slot, recomputed
        ratio = (slack["chats_per_row"] / slack["anchor_slots"]) / (trainer["chats_per_row"] / trainer["anchor_slots"])
        assert slack["chats_per_slot_vs_trainer"] == pytest.approx(ratio)
        lengths, anchors = bench.simulated_chats(shape, 4000)
        assert trainer["mean_tokens"] == pytest.approx(float(np.mean(lengths)))
