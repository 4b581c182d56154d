"""`benchmarks/regenerate.py --quick` runs end to end on a CPU with a tiny target (its GPU figures come from
an H200), and every variant gives the same greedy answers in float32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.regenerate import main
from tests.helpers.tiny_models import make_tiny_target


def test_quick_regeneration_benchmark_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = make_tiny_target("llama", num_layers=2)
    target.model.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    monkeypatch.setenv("DFLASH_BENCH_RESULTS", str(tmp_path / "results"))
    main(["--quick", "--target", str(tmp_path / "target"), "--device", "cpu"])
    result = json.loads((tmp_path / "results" / "regenerate.json").read_text())
    assert {"device", "date", "commit"} <= result.keys() and result["config"]["quick"] is True
    rows = {(r["variant"], r["rows"]): r for r in result["results"]}
    assert set(rows) == {("runtime (old default)", 2), ("runtime", 4), ("HF generate", 4), ("runtime", 8),
                         ("HF generate", 8)}
    for r in rows.values():
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["same_answers"] == r["prompts"], r
    assert rows[("runtime", 8)]["prompts"] == 12 and rows[("HF generate", 8)]["prompts"] == 8
