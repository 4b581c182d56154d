"""Runs side by side: each run's last validation record (a resumed run's re-logged steps count once)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipes.scoring.compare import loss_curve, main, run_row, tau_hat_curve


def write_run(run_dir: Path, records: list[dict], train_seconds: float | None = None) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if train_seconds is not None:
        state = run_dir / "checkpoints" / "step-00000200"
        state.mkdir(parents=True)
        (state / "trainer_state.json").write_text(json.dumps({"step": 200, "train_seconds": train_seconds}))
    return run_dir


def validation(step: int, tau: float, loss: float, **by_source: float) -> dict:
    record = {"split": "validation", "step": step, "loss": loss, "expected_acceptance_length": tau}
    if by_source:
        record["by_source"] = {name: {"expected_acceptance_length": value, "loss": 1.0} for name, value in by_source.items()}
    return record


def test_last_validation_of_each_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = write_run(tmp_path / "ablation-base", [
        {"split": "train", "step": 100, "loss": 3.0, "expected_acceptance_length": 1.9},
        validation(100, 1.8, 3.1, sharegpt=1.5, math=2.2),
        validation(200, 2.0, 2.9, sharegpt=1.6, math=2.5),
        validation(100, 9.9, 0.1),  # a resumed run re-logs step 100: the later record wins, not the last line
    ], train_seconds=180)
    anchors = write_run(tmp_path / "ablation-anchors128", [validation(400, 2.3, 2.7, sharegpt=1.9)])
    write_run(tmp_path / "ablation-early", [{"split": "train", "step": 5, "loss": 9.0}])  # no validation yet
    row = run_row(base)
    assert row == {"run": "ablation-base", "step": 200, "train_minutes": 3.0, "loss": 2.9, "tau_hat": 2.0,
                   "by_source": {"sharegpt": 1.6, "math": 2.5}}
    assert main([str(base), str(anchors), str(tmp_path / "ablation-early")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| run | step | train min | val loss | val τ̂ | τ̂ math | τ̂ sharegpt |"
    assert lines[2:] == ["| ablation-base | 200 | 3.0 | 2.900 | 2.00 | 2.50 | 1.60 |",
                         "| ablation-anchors128 | 400 | — | 2.700 | 2.30 | — | 1.90 |"]


def test_nothing_validated_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "missing")]) == 1
    assert "has a validation" in capsys.readouterr().err


def test_loss_curve_against_minutes_and_the_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    steps = [(10, 4.0, 30.0), (20, 3.0, 0.5), (30, 2.0, 0.5), (40, 1.0, 0.7)]  # the first step compiled
    train = [{"split": "train", "step": s, "loss": loss, "step_seconds": sec} for s, loss, sec in steps]
    run = write_run(tmp_path / "ablation-muon", [*train, validation(40, 1.7, 1.2)])
    minutes, losses = loss_curve(run, window=2)
    median = 0.6 / 60  # of 30, 0.5, 0.5, 0.7: (0.5 + 0.7) / 2
    assert minutes == pytest.approx([10 * median, 20 * median, 30 * median, 40 * median])
    assert losses == pytest.approx([4.0, 3.5, 2.5, 1.5])
    assert tau_hat_curve(run) == (pytest.approx([40 * median]), [1.7])
    out = tmp_path / "ablations.png"
    assert main([str(run), "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot -> {out}" in capsys.readouterr().out


def test_plot_never_replaces_a_file_that_is_not_a_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "ablation-base", [validation(10, 1.5, 3.0)])
    notes = tmp_path / "notes.png"
    notes.write_text("my notes")
    assert main([str(run), "--plot", str(notes)]) == 1
    assert notes.read_text() == "my notes" and "is not a plot" in capsys.readouterr().err


def test_tau_hat_curve_has_every_validation_once(tmp_path: Path) -> None:
    train = [{"split": "train", "step": s, "loss": 1.0, "step_seconds": 1.2} for s in (10, 20, 30)]
    records = [*train, validation(10, 1.5, 3.0), validation(20, 2.0, 2.5), validation(10, 1.6, 2.9)]  # resumed
    minutes, taus = tau_hat_curve(write_run(tmp_path / "run", records))
    assert minutes == pytest.approx([10 * 0.02, 20 * 0.02]) and taus == [1.6, 2.0]
    assert tau_hat_curve(write_run(tmp_path / "untimed", [validation(10, 1.5, 3.0)])) == ([], [])


def test_eval_reports_add_the_decoded_tau_of_each_set(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = write_run(tmp_path / "ablation-base", [validation(100, 2.0, 2.9, sharegpt=1.6)])
    soft = write_run(tmp_path / "ablation-soft", [validation(100, 2.2, 2.8, sharegpt=1.8)])
    write_run(tmp_path / "ablation-dpace", [validation(100, 2.1, 2.8)])
    evals = tmp_path / "eval"
    evals.mkdir()
    (evals / "ablation-base-b16.json").write_text(json.dumps({"datasets": {
        "mt-bench": {"acceptance_length": 2.5}, "humaneval": {"acceptance_length": 3.25}}}))
    (evals / "ablation-soft-b16.json").write_text(json.dumps({"datasets": {"mt-bench": {"acceptance_length": 2.75}}}))
    (evals / "ablation-dpace-b16.json").write_text("not json")  # a broken report shows as no figure
    assert main([str(base), str(soft), str(tmp_path / "ablation-dpace"), "--evals", str(evals)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| run | step | train min | val loss | val τ̂ | τ̂ sharegpt | τ humaneval | τ mt-bench |"
    assert lines[2:] == ["| ablation-base | 100 | — | 2.900 | 2.00 | 1.60 | 3.25 | 2.50 |",
                         "| ablation-soft | 100 | — | 2.800 | 2.20 | 1.80 | — | 2.75 |",
                         "| ablation-dpace | 100 | — | 2.800 | 2.10 | — | — | — |"]


def write_eval(path: Path, per_request: dict[str, list[list]]) -> None:
    """An eval report with each set's requests' τ (acceptance_length is their mean, as the eval writes it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets = {name: {"acceptance_length": sum(r[2] for r in rows) / len(rows), "acceptance_length_per_request": rows}
                for name, rows in per_request.items()}
    path.write_text(json.dumps({"datasets": datasets}))


def test_decoded_tau_is_paired_against_the_base(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = [write_run(tmp_path / name, [validation(100, 2.0, 3.0)]) for name in ("ablation-a32", "ablation-base")]
    evals = tmp_path / "eval"
    write_eval(evals / "ablation-base-b16.json", {"mt": [[0, 0, 3.0], [0, 1, 4.0], [1, 0, 5.0]]})
    # +0.5 on every request both measured; the base never measured (2, 0), so it is not paired.
    write_eval(evals / "ablation-a32-b16.json", {"mt": [[0, 0, 3.5], [0, 1, 4.5], [1, 0, 5.5], [2, 0, 1.0]]})
    assert main([*map(str, runs), "--evals", str(evals)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| run | step | train min | val loss | val τ̂ | τ mt | Δτ mt (95% CI) |"
    assert lines[2:] == ["| ablation-a32 | 100 | — | 3.000 | 2.00 | 3.62 | +0.50 (+0.50…+0.50)* |",
                         "| ablation-base | 100 | — | 3.000 | 2.00 | 4.00 | — |"]
    assert main([*map(str, runs), "--evals", str(evals), "--base", "ablation-a32"]) == 0
    assert capsys.readouterr().out.splitlines()[3] == "| ablation-base | 100 | — | 3.000 | 2.00 | 4.00 | -0.50 (-0.50…-0.50)* |"


def test_reports_without_requests_add_no_difference_column(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = [write_run(tmp_path / name, [validation(100, 2.0, 3.0)]) for name in ("ablation-base", "ablation-x")]
    for name, tau in (("ablation-base", 3.0), ("ablation-x", 3.2)):  # reports from before per-request τ
        (tmp_path / "eval").mkdir(exist_ok=True)
        (tmp_path / "eval" / f"{name}-b16.json").write_text(json.dumps({"datasets": {"mt": {"acceptance_length": tau}}}))
    assert main([*map(str, runs), "--evals", str(tmp_path / "eval")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "| run | step | train min | val loss | val τ̂ | τ mt |"


def test_an_unknown_base_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "ablation-base", [validation(100, 2.0, 3.0)])
    assert main([str(run), "--evals", str(tmp_path / "eval"), "--base", "ablation-typo"]) == 2
    assert capsys.readouterr().err.strip() == ("compare: --base ablation-typo is not one of the runs with a "
                                               "validation; give one of ablation-base")


def write_sweep_eval(path: Path, temperatures: list[float], per_request: list[list[list]]) -> None:
    """A sweep's report on one set "mt": its own figures the lowest temperature's, each temperature's requests'
    τ (per_request[i] at temperatures[i]) in its run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    runs = [{"temperature": t, "datasets": {"mt": {"acceptance_length": sum(r[2] for r in rows) / len(rows),
                                                   "acceptance_length_per_request": rows}}}
            for t, rows in zip(temperatures, per_request, strict=True)]
    path.write_text(json.dumps({"settings": {"temperature": temperatures[0], "temperatures": temperatures},
                                "datasets": runs[0]["datasets"], "temperature_sweep": {
                                    "temperatures": temperatures, "summary": {}, "runs": runs}}))


def test_runs_are_compared_at_a_chosen_temperature_of_their_sweeps(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """By default the reports' own figures (the sweep's lowest, 0); `--temperature 1` reads each report's run at
    1: its τ and the Δτ paired on its requests, the columns naming the temperature."""
    runs = [write_run(tmp_path / name, [validation(100, 2.0, 3.0)]) for name in ("ablation-base", "ablation-kl07")]
    evals = tmp_path / "eval"
    write_sweep_eval(evals / "ablation-base-b16.json", [0.0, 0.7, 1.0],
                     [[[0, 0, 4.0], [1, 0, 5.0]], [[0, 0, 3.5], [1, 0, 4.5]], [[0, 0, 3.0], [1, 0, 3.5]]])
    write_sweep_eval(evals / "ablation-kl07-b16.json", [0.0, 0.7, 1.0],
                     [[[0, 0, 3.75], [1, 0, 4.75]], [[0, 0, 3.75], [1, 0, 4.75]], [[0, 0, 3.5], [1, 0, 4.0]]])
    assert main([*map(str, runs), "--evals", str(evals)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| run | step | train min | val loss | val τ̂ | τ mt | Δτ mt (95% CI) |"
    assert lines[2:] == ["| ablation-base | 100 | — | 3.000 | 2.00 | 4.50 | — |",
                         "| ablation-kl07 | 100 | — | 3.000 | 2.00 | 4.25 | -0.25 (-0.25…-0.25)* |"]
    assert main([*map(str, runs), "--evals", str(evals), "--temperature", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| run | step | train min | val loss | val τ̂ | τ mt T=1 | Δτ mt T=1 (95% CI) |"
    assert lines[2:] == ["| ablation-base | 100 | — | 3.000 | 2.00 | 3.25 | — |",
                         "| ablation-kl07 | 100 | — | 3.000 | 2.00 | 3.75 | +0.50 (+0.50…+0.50)* |"]


def test_a_temperature_a_report_lacks_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A report of one temperature answers for its own (0 when it names none, as reports before the sweep);
    asked for another, compare names each run whose report lacks it and the temperatures it has."""
    runs = [write_run(tmp_path / name, [validation(100, 2.0, 3.0)]) for name in ("ablation-base", "ablation-x")]
    evals = tmp_path / "eval"
    write_sweep_eval(evals / "ablation-base-b16.json", [0.0, 1.0], [[[0, 0, 4.0], [1, 0, 5.0]], [[0, 0, 3.0], [1, 0, 4.0]]])
    write_eval(evals / "ablation-x-b16.json", {"mt": [[0, 0, 4.5], [1, 0, 5.5]]})  # no settings, no sweep: at 0
    assert main([*map(str, runs), "--evals", str(evals), "--temperature", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[3] == "| ablation-x | 100 | — | 3.000 | 2.00 | 5.00 | +0.50 (+0.50…+0.50)* |"
    assert main([*map(str, runs), "--evals", str(evals), "--temperature", "0.7"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.strip() == (
        "compare: no eval at temperature 0.7 in the reports of ablation-base at 0, 1; ablation-x at 0: evaluate "
        "them with --temperature listing 0.7, or give --temperature one they have")
    assert main([*map(str, runs), "--temperature", "1"]) == 2  # nothing to read it from
    assert capsys.readouterr().err.strip() == ("compare: --temperature takes a temperature >= 0 and reads the "
                                               "reports of --evals DIR; give both")
