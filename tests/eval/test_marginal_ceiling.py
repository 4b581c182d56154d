"""`python -m dflash_train.eval.marginal_ceiling` end to end on a tiny target and a prompt file: one report with
every temperature and set, the eval's acceptance statistics and the per-slot averages, the same for the same seed;
a bad flag, prompt set or target is one line and status 2 before anything decodes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dflash_train.eval.marginal_ceiling import REPORT_KIND, main
from tests.helpers.training import save_tiny_target

BLOCK = 4


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("ceiling")
    prompts = folder / "prompts.jsonl"
    rows = [{"turns": ["who are you ?"]}, {"turns": ["what is the capital of france ?", "be brief ."]}]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return save_tiny_target(folder / "target"), prompts


def run_tool(inputs: tuple[Path, Path], out: Path, *extra: str) -> dict[str, Any]:
    target, prompts = inputs
    status = main(["--target", str(target), "--prompts", str(prompts), "--max-new-tokens", "8", "--temperature",
                   "0.7,1", "--samples", "4", "--block-size", str(BLOCK), "--no-progress", "--output", str(out),
                   *extra])
    assert status == 0
    return json.loads(out.read_text())


def test_the_report_holds_every_temperature_and_set(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    report = run_tool(inputs, tmp_path / "report.json")
    assert report["kind"] == REPORT_KIND and report["complete"]
    assert report["settings"]["samples"] == 4 and report["environment"]["device"]
    assert list(report["temperatures"]) == ["0.7", "1"]
    for sets in report["temperatures"].values():
        row = sets["prompts"]
        assert row["conversations"] == 2 and row["requests"] == 3  # the second conversation's two turns
        assert 1 <= row["acceptance_length"] <= BLOCK
        assert sum(row["histogram"]) == row["cycles"] == row["slot_reached"][0]
        for key in ("per_slot_acceptance", "per_slot_conditional_acceptance", "slot_reached",
                    "per_slot_expected_acceptance_given_reached", "per_slot_mode_acceptance_given_reached"):
            assert len(row[key]) == BLOCK - 1, key
        # slot 1's draft comes from p_T(. | c) itself: always accepted
        assert row["per_slot_expected_acceptance_given_reached"][0] == pytest.approx(1.0, abs=1e-5)
        assert row["per_slot_conditional_acceptance"][0] == 1.0


def test_the_same_seed_gives_the_same_report(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    def figures(report: dict[str, Any]) -> dict[str, Any]:
        return {t: {name: (row["histogram"], row["acceptance_length_per_request"], row["slot_reached"])
                    for name, row in sets.items()} for t, sets in report["temperatures"].items()}

    first = run_tool(inputs, tmp_path / "a.json", "--seed", "3")
    assert figures(first) == figures(run_tool(inputs, tmp_path / "b.json", "--seed", "3"))


@pytest.mark.parametrize(("argv", "says"), [
    (["--temperature", "0"], "temperatures > 0"),
    (["--temperature", "0.7,0.70"], "twice"),
    (["--samples", "0"], "at least 1"),
    (["--block-size", "1"], "at least 2"),
    (["--bogus"], "unrecognized arguments"),
    (["--prompts", "missing.jsonl"], "unknown dataset"),
    (["--target", "no/such/dir", "--prompts", "humaneval"], "No target model"),
    (["--device", "abacus"], "not a device"),
])
def test_a_bad_command_line_is_one_line(argv: list[str], says: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--output", str(tmp_path / "report.json")]) == 2
    error = capsys.readouterr().err.strip()
    assert says in error and len(error.splitlines()) == 1
    assert not (tmp_path / "report.json").exists()
