"""`dflash-train eval --temperature 0,0.7,...` end to end on a tiny target: one report whose own figures are
the lowest temperature's (read as a single-temperature report is) and whose `temperature_sweep` holds every
temperature's; each temperature decodes as a run at that temperature alone would; the figure gains a panel of τ
against temperature; bad lists are one-line errors before anything loads."""

from __future__ import annotations

import io
import json
import struct
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from dflash_train.checkpoint.card import load_eval_reports
from dflash_train.cli import main
from dflash_train.commands import eval as eval_command
from dflash_train.eval.report import REPORT_DEFINITIONS
from tests.helpers.training import save_tiny_target

DATASETS = ("humaneval", "math-synthetic")


def run_eval(target: Path, out: Path, temperature: str, *extra: str) -> tuple[int, str]:
    stdout = io.StringIO()
    with redirect_stdout(stdout):
        status = main(["eval", "--target", str(target), "--draft", "random", "--random-draft-layers", "1",
                       "--block-size", "4", "--dataset", DATASETS[0], "--dataset", DATASETS[1], "--num-prompts", "2",
                       "--max-new-tokens", "6", "--device", "cpu", "--no-progress", "--out", str(out),
                       "--temperature", temperature, *extra])
    return status, stdout.getvalue()


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("target") / "target")


@pytest.fixture(scope="module")
def sweep(target: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    out = tmp_path_factory.mktemp("sweep") / "report.json"
    status, stdout = run_eval(target, out, "1.0,0,0.7")  # in any order: run and reported in increasing order
    assert status == 0
    return json.loads(out.read_text()), stdout, out


def png_width(path: Path) -> int:
    return struct.unpack(">I", path.read_bytes()[16:20])[0]


def test_the_reports_own_figures_are_the_lowest_temperatures(sweep: tuple[dict[str, Any], str, Path]) -> None:
    report = sweep[0]
    section = report["temperature_sweep"]
    assert section["temperatures"] == report["settings"]["temperatures"] == [0.0, 0.7, 1.0]
    assert report["settings"]["temperature"] == 0.0 and report["settings"]["lossless_check"] is True
    assert [run["temperature"] for run in section["runs"]] == [0.0, 0.7, 1.0]
    assert section["runs"][0]["datasets"] == report["datasets"]
    for name in DATASETS:
        assert report["datasets"][name]["lossless"] is True  # exact at T = 0
        assert [run["datasets"][name]["lossless"] for run in section["runs"][1:]] == [None, None]  # sampled
        summary = section["summary"][name]
        taus = [run["datasets"][name]["acceptance_length"] for run in section["runs"]]
        assert summary["acceptance_length"] == taus and len(summary["speedup"]) == 3
        assert summary["fraction_of_greedy"] == [tau / taus[0] for tau in taus]
    assert {"temperature_sweep", "fraction_of_greedy"} <= report["definitions"].keys()


def test_every_temperature_decodes_as_it_would_alone(target: Path, sweep: tuple[dict[str, Any], str, Path],
                                                     tmp_path: Path) -> None:
    """The same prompts and seed: a run at 0.7 alone gives what the sweep gave at 0.7, request by request."""
    status, _ = run_eval(target, tmp_path / "alone.json", "0.7", "--no-plot")
    assert status == 0
    alone = json.loads((tmp_path / "alone.json").read_text())
    swept = sweep[0]["temperature_sweep"]["runs"][1]["datasets"]
    for name in DATASETS:
        for key in ("acceptance_length_per_request", "histogram", "new_tokens_with_draft", "new_tokens_target_only"):
            assert alone["datasets"][name][key] == swept[name][key], (name, key)


def test_one_temperature_writes_the_report_it_always_did(target: Path, tmp_path: Path) -> None:
    status, stdout = run_eval(target, tmp_path / "one.json", "0.7")
    report = json.loads((tmp_path / "one.json").read_text())
    assert status == 0 and "temperature_sweep" not in report and "temperatures" not in report["settings"]
    assert report["settings"]["temperature"] == 0.7 and report["definitions"] == REPORT_DEFINITIONS
    assert "τ against temperature" not in stdout
    assert png_width(tmp_path / "one.png") == 1100  # two panels a row


def test_the_figure_and_the_summary_show_tau_against_temperature(sweep: tuple[dict[str, Any], str, Path]) -> None:
    report, stdout, out = sweep
    assert png_width(out.with_suffix(".png")) == 1650  # a third panel a row: τ and speedup against temperature
    table = stdout[stdout.index("τ against temperature"):]
    for name in DATASETS:
        assert name in table
    assert "temperature 0)" in stdout  # the main table says which temperature it shows
    phases = report["phase_seconds"]
    assert {f"decode/{name}@T={t}/dflash" for name in DATASETS for t in ("0", "0.7", "1")} <= phases.keys()
    assert "decode/humaneval@T=0/lossless_check" in phases and "decode/humaneval@T=0.7/lossless_check" not in phases


def test_the_model_card_reads_the_lowest_temperature(sweep: tuple[dict[str, Any], str, Path]) -> None:
    rows = load_eval_reports([sweep[2]])
    assert [row["dataset"] for row in rows] == list(DATASETS) and {row["temperature"] for row in rows} == {0.0}


@pytest.mark.parametrize(("value", "expected"), [
    ("0,-1", "takes a number >= 0 (0: greedy) or a comma list of them, not '-1' (in '0,-1')"),
    ("0,nan", "takes a number >= 0 (0: greedy) or a comma list of them, not 'nan' (in '0,nan')"),
    ("0.7,inf", "not 'inf' (in '0.7,inf')"),
    ("0,hot", "not 'hot' (in '0,hot')"),
    ("0.7,0.70", "lists temperature 0.7 twice ('0.7,0.70'); give each once"),
    ("0,0.0", "lists temperature 0 twice ('0,0.0'); give each once"),
    ("0,,1", "takes a number >= 0 (0: greedy) or a comma list of them, not '0,,1': an item is empty"),
    ("0.7,", "an item is empty"),
    ("", "not '': an item is empty"),
])
def test_bad_lists_are_one_line_errors_before_anything_loads(value: str, expected: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the command went on to load the target")

    monkeypatch.setattr(eval_command, "_load_target", never)
    assert main(["eval", "--target", "t", "--draft", "random", "--dataset", "humaneval", "--device", "cpu",
                 "--out", str(tmp_path / "r.json"), f"--temperature={value}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dflash-train eval: error: argument --temperature: ")
    assert expected in lines[0]


def test_the_target_cache_keeps_one_pass_per_temperature(target: Path, tmp_path: Path) -> None:
    """A target-alone pass sampled at 0.7 is never read back as the greedy one: the cache's key holds the
    temperature, and a second sweep reads each temperature's own."""
    cache = tmp_path / "cache"
    for name in ("first", "second"):
        status, _ = run_eval(target, tmp_path / f"{name}.json", "0,0.7", "--no-plot", "--target-cache", str(cache))
        assert status == 0
    first, second = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("first", "second"))
    for report, reused in ((first, False), (second, True)):
        for run in report["temperature_sweep"]["runs"]:
            assert all(row["target_only_reused"] is reused for row in run["datasets"].values())
    greedy, sampled = (run["datasets"] for run in second["temperature_sweep"]["runs"])
    assert greedy["humaneval"]["lossless"] is True and sampled["humaneval"]["lossless"] is None


def test_argmax_drafts_at_a_temperature_reach_the_engine_and_the_report(target: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`--draft-temperature-scale 0`: the engines decode with argmax drafts at T = 0.7, and the report says so
    (their output distribution: tests/runtime/test_sampling.py)."""
    built = []
    runtime_config = eval_command._runtime_config
    monkeypatch.setattr(eval_command, "_runtime_config",
                        lambda *a, **k: built.append(runtime_config(*a, **k)) or built[-1])
    status, _ = run_eval(target, tmp_path / "argmax.json", "0.7", "--draft-temperature-scale", "0")
    report = json.loads((tmp_path / "argmax.json").read_text())
    assert status == 0 and report["settings"]["draft_temperature_scale"] == 0.0
    assert built and all(c.draft_temperature_scale == 0.0 and c.temperature == 0.7 for c in built)


def test_a_negative_draft_temperature_scale_is_a_one_line_error(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--target", "t", "--draft", "random", "--dataset", "humaneval", "--device", "cpu",
                 "--out", str(tmp_path / "r.json"), "--draft-temperature-scale=-0.5"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "argument --draft-temperature-scale: takes a number >= 0" in lines[0]
