"""Phase timing: phases accumulate, never overlap, add up to at most the total; the console line groups them."""

from __future__ import annotations

import time

import pytest

from dflash_train.eval.phases import TOTAL, PhaseTimer, timing_line


def test_phases_accumulate_in_first_run_order_and_fit_in_the_total() -> None:
    timer = PhaseTimer()
    for name in ("load/target", "decode/a/dflash", "load/target"):
        with timer.phase(name):
            time.sleep(0.01)
    report = timer.report()
    assert list(report) == ["load/target", "decode/a/dflash", TOTAL]
    assert report["load/target"] >= 0.02 and report["decode/a/dflash"] >= 0.01  # entered twice: both counted
    assert report[TOTAL] + 1e-9 >= sum(v for k, v in report.items() if k != TOTAL)  # floats of hundredths


def test_a_phase_that_raises_is_still_counted_and_closed() -> None:
    timer = PhaseTimer()
    with pytest.raises(ValueError), timer.phase("load/draft"):
        raise ValueError("bad checkpoint")
    with timer.phase("load/target"):  # not refused as nested in the failed one
        pass
    assert set(timer.report()) == {"load/draft", "load/target", TOTAL}


def test_nested_phases_are_refused() -> None:
    timer = PhaseTimer()
    with pytest.raises(RuntimeError, match="must not overlap"), timer.phase("decode/a/dflash"), timer.phase("x"):
        pass


def test_the_line_sums_groups_and_decode_engines() -> None:
    phases = {"load/target": 1.0, "load/draft": 0.5, "warm_up/dflash": 3.0, "decode/a/target_only": 1.0,
              "decode/a/dflash": 2.0, "decode/b/dflash": 1.0, "teacher_forced/a": 0.3, TOTAL: 10.0}
    line = timing_line({"phase_seconds": phases})
    assert line == ("time: load 1.5 s · warm-up 3.0 s · teacher-forced 0.3 s · decode 4.0 s (draft 3.0, "
                    "target 1.0) · other 1.2 s · total 10.0 s")


def test_a_report_without_phase_times_has_no_line() -> None:
    assert timing_line({"datasets": {}}) is None
