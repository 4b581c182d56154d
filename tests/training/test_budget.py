"""Time limits of a run: a budget the schedule is fitted into, and stop-then-resume."""

from __future__ import annotations

import json
import pathlib

import pytest

from dflash_train.training import budget as budget_module
from dflash_train.training.budget import TimeBudget
from dflash_train.training.config import load_config
from dflash_train.training.trainer import run_training
from tests.helpers.training import overrides, train_losses


def test_budget_settles_the_length_from_the_median_warm_step(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(budget_module.time, "monotonic", lambda: clock[0])
    budget = TimeBudget(total_minutes=10, stop_after_minutes=None)
    budget.start()
    steps = [30.0, 20.0, 10.0] + [2.0] * (budget_module.PROBE_STEPS - 3)  # compile steps first
    settled = None
    for step, seconds in enumerate(steps, 1):
        clock[0] += seconds
        settled = budget.observe(seconds, step, total_steps=10_000)
        assert (settled is None) == (step < budget_module.PROBE_STEPS)
    spent = sum(steps)
    expected = budget_module.PROBE_STEPS + int(budget_module.MARGIN * (600 - spent) / 2.0)
    assert settled == expected
    assert budget.observe(2.0, 13, expected) is None  # settled once


def test_budget_excluding_warmup_gives_the_compiling_steps_for_free(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(budget_module.time, "monotonic", lambda: clock[0])
    steps = [30.0, 20.0, 10.0] + [2.0] * (budget_module.PROBE_STEPS - 3)
    settled = {}
    for exclude in (False, True):
        budget = TimeBudget(total_minutes=10, stop_after_minutes=None, exclude_warmup=exclude)
        budget.start()
        for step, seconds in enumerate(steps, 1):
            clock[0] += seconds
            settled[exclude] = budget.observe(seconds, step, total_steps=10_000)
    warm = sum(steps[budget_module.WARM_STEPS:])  # what the excluding budget has spent at the fit
    assert settled[True] == budget_module.PROBE_STEPS + int(budget_module.MARGIN * (600 - warm) / 2.0)
    assert settled[True] - settled[False] == int(budget_module.MARGIN * (600 - warm) / 2.0) - int(
        budget_module.MARGIN * (600 - sum(steps)) / 2.0)


def test_budget_refits_when_the_gpu_frees_up_but_never_past_the_configured_length(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(budget_module.time, "monotonic", lambda: clock[0])
    budget = TimeBudget(total_minutes=10, stop_after_minutes=None)
    budget.start()

    def run(seconds: float, steps: range, total: int, limit: int) -> list[int | None]:
        fitted = []
        for step in steps:
            clock[0] += seconds
            fitted.append(budget.observe(seconds, step, total, limit))
        return fitted

    probe = run(2.0, range(1, budget_module.PROBE_STEPS + 1), total=10_000, limit=10_000)
    total = probe[-1]
    assert total == budget_module.PROBE_STEPS + int(budget_module.MARGIN * (600 - 24) / 2.0)
    # Three other jobs finish: steps take a quarter of the time. The next fit (REFIT_STEPS later) sees it.
    first = budget_module.PROBE_STEPS + 1
    fitted = run(0.5, range(first, first + budget_module.REFIT_STEPS), total, limit=10_000)
    assert fitted[:-1] == [None] * (budget_module.REFIT_STEPS - 1)
    step = first + budget_module.REFIT_STEPS - 1
    expected = step + int(budget_module.MARGIN * (600 - clock[0]) / 0.5)
    assert fitted[-1] == expected and budget.worth_refitting(expected, total, step)
    # Same speed again: a fit within the tolerance is not worth moving the schedule for.
    nearly = expected + int(0.1 * (expected - step))
    assert not budget.worth_refitting(nearly, expected, step)
    # A configured length below the fit caps it.
    capped = run(0.5, range(step + 1, step + 1 + budget_module.REFIT_STEPS), expected, limit=step + 60)
    assert capped[-1] == step + 60


def test_budget_never_lengthens_a_run() -> None:
    budget = TimeBudget(total_minutes=1e6, stop_after_minutes=None)
    budget.start()
    results = [budget.observe(0.001, step, total_steps=50) for step in range(1, budget_module.PROBE_STEPS + 1)]
    assert results[-1] == 50


def test_stop_after_then_resume_equals_the_uninterrupted_run(assets: dict[str, pathlib.Path],
                                                             tmp_path: pathlib.Path) -> None:
    steps = 16
    reference = tmp_path / "reference"
    run_training(load_config(None, overrides(assets, reference, **{"training.max_steps": steps})))
    out = tmp_path / "stopped"
    first = run_training(load_config(None, overrides(assets, out, **{
        "training.max_steps": steps, "training.stop_after_minutes": 1e-9})))
    assert first.steps == 1 and not first.finished  # stopped after its first step, with a checkpoint
    state = json.loads((out / "checkpoints" / "step-00000001" / "trainer_state.json").read_text())
    assert state["step"] == 1 and state["train_seconds"] > 0
    second = run_training(load_config(None, overrides(assets, out, **{"training.max_steps": steps})))
    assert second.steps == steps and second.finished
    expected, got = train_losses(reference), train_losses(out)
    assert sorted(got) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-6), step


def test_budgeted_run_keeps_its_settled_length_on_resume(assets: dict[str, pathlib.Path],
                                                         tmp_path: pathlib.Path) -> None:
    out = tmp_path / "budgeted"
    tiny_budget = {"training.max_steps": 400, "training.time_budget_minutes": 1e-6}
    first = run_training(load_config(None, overrides(assets, out, **tiny_budget)))
    assert first.steps == budget_module.PROBE_STEPS  # the probe steps alone overrun a 60 µs budget
    state = json.loads((out / "checkpoints" / f"step-{first.steps:08d}" / "trainer_state.json").read_text())
    assert state["total_steps"] == first.steps and state["budget_sized"]
    again = run_training(load_config(None, overrides(assets, out, **tiny_budget)))
    assert again.steps == first.steps  # resumed at its end: nothing more to do


def test_a_finished_run_can_be_extended_by_a_larger_max_steps(assets: dict[str, pathlib.Path],
                                                              tmp_path: pathlib.Path) -> None:
    out = tmp_path / "extended"
    assert run_training(load_config(None, overrides(assets, out, **{"training.max_steps": 4}))).steps == 4
    longer = run_training(load_config(None, overrides(assets, out, **{"training.max_steps": 8})))
    assert longer.steps == 8 and longer.finished and sorted(train_losses(out)) == list(range(1, 9))


def test_budget_fits_and_refits_in_step_on_two_processes(assets: dict[str, pathlib.Path],
                                                         tmp_path: pathlib.Path) -> None:
    """Every rank fits (step 12) and refits (step 62) on the same steps, through one all-reduce each: a rank
    that skipped one would hang the other. The run keeps its configured length (the budget is ample)."""
    from dflash_train.training.tracking import read_metrics
    from tests.helpers.training import train_on_two_cpu_processes

    steps = budget_module.PROBE_STEPS + budget_module.REFIT_STEPS + 2
    out = tmp_path / "budgeted"
    train_on_two_cpu_processes(overrides(assets, out, **{"training.max_steps": steps, "training.batch_size": 1,
                                                         "training.time_budget_minutes": 1e3,
                                                         "training.eval_every": 0}), port_base=28500)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")["train"]][-1] == steps
