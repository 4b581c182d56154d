"""`benchmarks/data_prep.py` runs at tiny sizes on the real SmolLM2 tokenizer, and its batched planning and
pooled prepare give the baseline's output (its GPU-host figures come from a 16-core machine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.data_prep import main
from tests.helpers.markers import needs_smollm2


@needs_smollm2
def test_data_prep_benchmark_quick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_BENCH_RESULTS", str(tmp_path))  # never the committed results
    payload = main(["--quick"])
    written = json.loads((tmp_path / "data_prep.json").read_text())
    assert written["results"] == payload["results"]
    variants = {(r["stage"], r["variant"]): r for r in payload["results"]}
    assert len(variants) == 4 and all(r["same_output"] for r in variants.values())
    assert all(r["rows"] > 0 and r["rows_per_s"] > 0 for r in variants.values())
