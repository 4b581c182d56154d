"""The eval report's phase times, end to end on a tiny target: every phase of the run, none negative, within
the total; the summary's time line; the report still read as export reads it."""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from dflash_train.checkpoint.card import load_eval_reports
from dflash_train.cli import main
from tests.helpers.training import save_tiny_target

DATASETS = ("humaneval", "mt-bench")
LINE = re.compile(r"time: load [\d.]+ s · warm-up [\d.]+ s · prompts [\d.]+ s · teacher-forced [\d.]+ s · "
                  r"decode [\d.]+ s \(draft [\d.]+, target [\d.]+, check [\d.]+\) · report [\d.]+ s"
                  r"( · other [\d.]+ s)? · total [\d.]+ s")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    root = tmp_path_factory.mktemp("eval")
    target = save_tiny_target(root / "target")
    out = root / "report.json"
    stdout = io.StringIO()  # one run for the module: capsys is per test
    with redirect_stdout(stdout):
        status = main(["eval", "--target", str(target), "--draft", "random", "--random-draft-layers", "1",
                       "--block-size", "4", "--dataset", DATASETS[0], "--dataset", DATASETS[1], "--num-prompts", "2",
                       "--max-new-tokens", "4", "--device", "cpu", "--no-progress", "--out", str(out)])
    assert status == 0
    return json.loads(out.read_text()), stdout.getvalue(), out


def test_every_phase_is_timed(run: tuple[dict[str, Any], str, Path]) -> None:
    phases = run[0]["phase_seconds"]
    per_dataset = {f"{kind}/{name}" for name in DATASETS for kind in ("prompts", "teacher_forced")}
    decode = {f"decode/{name}/{engine}" for name in DATASETS for engine in ("target_only", "dflash", "lossless_check")}
    assert set(phases) == {"load/prompts", "load/target", "load/draft", "prompts/reserve", "warm_up/build",
                           "warm_up/runner_check", "warm_up/target_only", "warm_up/dflash", "warm_up/lossless_check",
                           "report/plot", "total"} | per_dataset | decode
    assert list(phases)[-1] == "total" and list(phases).index("load/target") < list(phases).index("warm_up/dflash")
    assert all(isinstance(v, float) and v >= 0 and round(v, 2) == v for v in phases.values())
    assert phases["total"] + 1e-9 >= sum(v for k, v in phases.items() if k != "total")  # floats of hundredths


def test_the_summary_ends_with_the_time_line(run: tuple[dict[str, Any], str, Path]) -> None:
    lines = run[1].splitlines()
    timing = [line for line in lines if line.startswith("time: ")]
    assert len(timing) == 1 and LINE.fullmatch(timing[0]), timing
    assert lines.index(timing[0]) > max(i for i, line in enumerate(lines) if "humaneval" in line)  # after the table


def test_export_reads_the_report(run: tuple[dict[str, Any], str, Path]) -> None:
    rows = load_eval_reports([run[2]])
    assert [row["dataset"] for row in rows] == list(DATASETS)


@pytest.mark.parametrize(("report", "message"), [
    ({"datasets": {"humaneval": 2.5}}, "an eval report's dataset 'humaneval' holds a JSON number, not an object; "
                                       "pass a report `dflash-train eval` wrote"),
    ({"datasets": {}, "settings": "greedy"}, "an eval report's 'settings' and 'environment' must be objects; pass a "
                                             "report `dflash-train eval` wrote"),
])
def test_export_refuses_a_report_of_the_wrong_shape_in_one_line(tmp_path: Path, report: dict[str, Any],
                                                                 message: str) -> None:
    """`export --eval-report` with such a file ended in an AttributeError from the model card's table."""
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    with pytest.raises(ValueError) as error:
        load_eval_reports([path])
    assert str(error.value) == message
