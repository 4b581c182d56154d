"""The summary printed after an eval: the table, skipped prompts, the time line where the report has phase times
(reports written before them still print, without it)."""

from __future__ import annotations

from typing import Any

import pytest

from dflash_train.eval.console import print_summary


def report(**extra: Any) -> dict[str, Any]:
    row = {"requests": 4, "acceptance_length": 2.5, "acceptance_length_cycle_weighted": 2.4,
           "teacher_forced_acceptance_length": 2.8, "lossless": True, "tokens_per_s_with_draft": 120.0,
           "tokens_per_s_target_only": 60.0, "speedup": 2.0, "skipped": ""}
    return {"target": "t", "draft": "d", "settings": {"block_size": 4}, "datasets": {"humaneval": row}, **extra}


def test_an_older_report_prints_without_the_time_line(capsys: pytest.CaptureFixture[str]) -> None:
    print_summary(report(), ["report.json"])
    out = capsys.readouterr().out
    assert "humaneval" in out and "2.00×" in out and "written: report.json" in out
    assert "time:" not in out


def test_phase_times_print_one_line_before_the_written_files(capsys: pytest.CaptureFixture[str]) -> None:
    phases = {"load/target": 2.0, "warm_up/dflash": 5.0, "decode/humaneval/dflash": 1.0, "total": 9.0}
    print_summary(report(phase_seconds=phases), ["report.json"])
    lines = capsys.readouterr().out.splitlines()
    timing = [line for line in lines if line.startswith("time: ")]
    assert len(timing) == 1 and timing[0].endswith("total 9.0 s")
    assert lines.index(timing[0]) == len(lines) - 2 and lines[-1] == "written: report.json"
