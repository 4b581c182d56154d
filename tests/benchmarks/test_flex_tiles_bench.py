"""The flex-tiles benchmark's packed rows and its CPU smoke run (the kernels it compares need a GPU)."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from benchmarks import flex_tiles as bench


def test_packed_rows_place_each_anchor_in_its_chat() -> None:
    rows = bench.packed_rows(rows=2, context=4096, anchors=64, block=16)
    context_sequence, anchors = rows["context_sequence"], rows["anchors"]
    for row in range(2):
        chats = context_sequence[row]
        assert chats[0] == 0 and bool((chats.diff() >= 0).all()) and bool((chats.diff() <= 1).all())
        lengths = torch.bincount(chats)
        assert int(lengths[:-1].min()) >= 256 and int(lengths.max()) <= 2048  # the last chat is cut at the row's end
        assert bool((anchors[row].diff() > 0).all()) and int(anchors[row, 0]) >= 1 and int(anchors[row, -1]) < 4096
        assert torch.equal(rows["anchor_sequence"][row], chats[anchors[row]])


def test_the_smoke_run_builds_every_option_set_and_agrees(tmp_path: pathlib.Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU, uncompiled: the 64-token tiles' mask gives the 128-token tiles' attention, and computes more,
    smaller tiles; the sets with inductor's backward candidates fitted run too."""
    monkeypatch.setenv("DFLASH_BENCH_RESULTS", str(tmp_path))
    bench.main(["--tiny"])
    results = json.loads((tmp_path / "flex_tiles.json").read_text())["results"]
    assert [r["option_set"] for r in results] == list(bench.OPTION_SETS)
    assert all(r["built"] for r in results)
    assert all(r["max_diff_out"] < 1e-5 for r in results[1:])
    for result in results[1:]:  # 64-token tiles compute more, smaller tiles; the 128-token ones under the fit, the same
        tile = bench.OPTION_SETS[result["option_set"]][0]
        assert (result["tiles_computed"] > results[0]["tiles_computed"]) == (tile == 64)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message is for machines without a GPU")
def test_without_a_gpu_it_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main([])
    assert exit_info.value.code == 2 and "pass --tiny" in capsys.readouterr().out
