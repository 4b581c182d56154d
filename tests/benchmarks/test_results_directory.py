"""Where benchmarks write their JSON: a smoke run (--tiny, --quick) never replaces the figures measured on a GPU
in benchmarks/results/; an explicit DFLASH_BENCH_RESULTS is used as given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import common
from benchmarks.common import RESULTS_DIR, results_directory, write_result


def test_smoke_runs_go_to_the_ignored_smoke_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DFLASH_BENCH_RESULTS", raising=False)
    assert results_directory() == RESULTS_DIR
    assert results_directory(smoke=True) == RESULTS_DIR / "smoke"
    ignored = (Path(__file__).parents[2] / ".gitignore").read_text().splitlines()
    assert "benchmarks/results/smoke/" in ignored


def test_an_explicit_folder_is_used_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_BENCH_RESULTS", str(tmp_path))
    assert results_directory(smoke=True) == results_directory() == tmp_path


def test_write_result_keeps_the_measured_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DFLASH_BENCH_RESULTS", raising=False)
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    measured = tmp_path / "thing.json"
    measured.write_text('{"device": "H200"}')
    path = write_result("thing", {"x": 1}, smoke=True)
    assert path == tmp_path / "smoke" / "thing.json" and json.loads(path.read_text())["x"] == 1
    assert json.loads(measured.read_text()) == {"device": "H200"}
