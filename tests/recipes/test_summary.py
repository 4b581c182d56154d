"""The recipe run summary joins each eval report with the training run it belongs to."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_train.eval import sweep as eval_sweep
from recipes.scoring.summary import main, summary_rows
from tests.helpers.eval_reports import result, sweep_section, write_report


def test_rows_pair_reports_with_training_state(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    state = tmp_path / "train" / "main" / "checkpoints" / "step-00000300"
    state.mkdir(parents=True)
    (state / "trainer_state.json").write_text(json.dumps({"step": 300, "sequences_seen": 4800, "train_seconds": 600}))
    write_report(tmp_path / "eval" / "main-b16.json", 16,
                 {"humaneval": {**result(5.5, True), "acceptance_length_ci95": [5.14, 5.86]}})
    write_report(tmp_path / "eval" / "main-b8.json", 8, {"mt-bench": result(3.2, False, ties=True)})
    write_report(tmp_path / "eval" / "ablation-x.json", 16, {"humaneval": result(4.0, False, speedup=None)}, batch=8)
    # Reports with phase times and older ones without them, side by side.
    write_report(tmp_path / "eval" / "main-fp32.json", 16, {"humaneval": result(5.4, True)}, dtype="float32",
                 phase_seconds={"load/target": 1.5, "total": 30.0})
    rows = {(r["run"], r["block"], r["dtype"]): r for r in summary_rows(tmp_path)}
    assert rows[("main", 16, "bfloat16")]["steps"] == 300 and rows[("main", 16, "bfloat16")]["train_minutes"] == 10.0
    assert rows[("main", 8, "bfloat16")]["lossless"] == "ties (1)" and rows[("main", 16, "bfloat16")]["lossless"] == "yes"
    assert rows[("ablation-x", 16, "bfloat16")]["steps"] is None and rows[("ablation-x", 16, "bfloat16")]["lossless"] == "NO (3/4)"
    assert rows[("main", 16, "float32")]["steps"] == 300  # the float32 report belongs to the run `main`
    assert main([str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "| main | 16 | 1 | bfloat16 | humaneval | 4 | 5.50 | 5.14–5.86 | 6.00 | yes | 2.00× | — | 300 | 4800 | 10.0 |" in table
    assert "| main | 16 | 1 | float32 | humaneval | 4 | 5.40 | — | 5.90 |" in table  # a report without the interval
    assert "| ablation-x | 16 | 8 | bfloat16 | humaneval |" in table
    assert table.splitlines()[0] == "training: main: 300 steps in 10.0 min, median step —, first step — (compilation included)"
    assert table.endswith((tmp_path / "summary.md").read_text())  # the table after the training line
    assert "T=" not in table and all(r["temperature_sweep"] is None for r in summary_rows(tmp_path))  # no sweep


def test_no_reports_is_a_one_line_error(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    assert main([str(tmp_path)]) == 1
    assert "run the eval stage first" in capsys.readouterr().err


def write_regen_stats(folder: Path, units: int, rows: int, tokens: int, per_second: float) -> None:
    folder.mkdir()
    tally = {"units": units, "rows": rows, "answer_tokens": tokens, "prompt_tokens": 1, "finish_reasons": {}}
    (folder / "regen_stats.json").write_text(json.dumps({
        "num_units": 34, "this_run": tally, "all_shards": tally, "decoding_seconds": 108.0, "command_seconds": 166.1,
        "answer_tokens_per_second_decoding": per_second, "answer_tokens_per_second_overall": 57263.3}))


def test_a_regeneration_stats_file_adds_a_line(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    write_regen_stats(tmp_path / "regen", 12, 49152, 9510512, 88040.0)
    write_report(tmp_path / "eval" / "main-b16.json", 16, {"humaneval": result(5.5, True)})
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == ("regeneration: regen: 49,152 answers, 9,510,512 answer tokens (12 of 34 units), "
                                   "88,040 tokens/s while decoding, 57,263 overall")
    assert out.endswith((tmp_path / "summary.md").read_text())  # the table as before
    assert json.loads((tmp_path / "summary_regeneration.json").read_text())["regen"]["answers"] == 49152
    assert isinstance(json.loads((tmp_path / "summary.json").read_text()), list)


def test_sampled_answers_beside_the_greedy_ones_get_a_line_of_their_own(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    write_regen_stats(tmp_path / "regen", 34, 158933, 35022007, 138600.0)
    write_regen_stats(tmp_path / "regen-sampled", 11, 45056, 12000000, 51000.0)
    write_report(tmp_path / "eval" / "main-b16.json", 16, {"humaneval": result(5.5, True)})
    assert main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("regeneration: regen: 158,933 answers")
    assert lines[1].startswith("regeneration: regen-sampled: 45,056 answers, 12,000,000 answer tokens (11 of 34 units)")
    assert set(json.loads((tmp_path / "summary_regeneration.json").read_text())) == {"regen", "regen-sampled"}


def test_tau_by_turn_and_category_follow_the_table(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    mt_bench = {**result(3.15, True), "acceptance_length_by_turn": [2.75, 3.56],
                "acceptance_length_by_category": {"writing": 3.1, "coding": None}}
    one_turn = {**result(3.75, True), "acceptance_length_by_turn": [3.75], "acceptance_length_by_category": None}
    write_report(tmp_path / "eval" / "main-b16.json", 16, {"mt-bench": mt_bench, "humaneval": one_turn})
    assert main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == ("τ of main (bfloat16, batch 1) on mt-bench: by turn 2.75 / 3.56; "
                         "by category writing 3.10, coding —")
    assert not [line for line in lines if "on humaneval:" in line]  # one turn, no categories: nothing to add
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert rows[0]["tau_by_turn"] == [2.75, 3.56] and rows[0]["tau_by_category"]["writing"] == 3.1


def test_each_training_run_gets_a_line_with_its_median_and_first_step(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """From the last trainer_state (steps, minutes, the cold first step) and metrics.jsonl (the median of the
    logged train steps, validation records ignored); a run older than the first-step field shows a dash."""
    for name, first in (("main", 67.812), ("old", None)):
        state = tmp_path / "train" / name / "checkpoints" / "step-00000040"
        state.mkdir(parents=True)
        (state / "trainer_state.json").write_text(json.dumps(
            {"step": 40, "train_seconds": 90, **({"first_step_seconds": first} if first else {})}))
    records = [{"split": "train", "step": 10 * (i + 1), "step_seconds": s} for i, s in enumerate((0.2, 0.1, 0.3, 0.15))]
    records.append({"split": "validation", "step": 40, "loss": 1.0})
    (tmp_path / "train" / "main" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    write_report(tmp_path / "eval" / "main-b16.json", 16, {"humaneval": result(5.5, True)})
    assert main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "training: main: 40 steps in 1.5 min, median step 0.2 s, first step 67.8 s (compilation included)"
    assert lines[1] == "training: old: 40 steps in 1.5 min, median step — s, first step — s (compilation included)".replace(
        "— s", "—")


def test_a_cycle_is_priced_in_target_steps_from_the_reports_timings(tmp_path: Path) -> None:
    """1.2 ms a cycle against 0.9 ms a target-alone token: a cycle costs 1.33 steps, and the speedup is the
    tokens per cycle (3.0 here) over that: 2.25x."""
    timed = {**result(3.0, True, speedup=2.25), "decode_seconds_with_draft": 1.2, "cycles": 1000,
             "decode_seconds_target_only": 0.9, "new_tokens_target_only": 1000, "new_tokens_with_draft": 3000}
    write_report(tmp_path / "eval" / "main-b16.json", 16, {"humaneval": timed, "mt-bench": result(3.0, True)})
    rows = {r["dataset"]: r for r in summary_rows(tmp_path)}
    assert abs(rows["humaneval"]["cycle_in_steps"] - 4 / 3) < 1e-12 and rows["mt-bench"]["cycle_in_steps"] is None
    tokens_per_cycle = timed["new_tokens_with_draft"] / timed["cycles"]
    assert abs(tokens_per_cycle / rows["humaneval"]["cycle_in_steps"] - timed["speedup"]) < 1e-12


def test_the_prepared_chats_add_a_data_line(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """The ≥ 150k distinct conversations a run trained on are read off one line: kept chats and drops."""
    (tmp_path / "prepared").mkdir()
    counts = {"read": 53248, "kept": 51354, "tokens": 15948806, "supervised tokens": 10882099,
              "dropped": {"too_few_supervised_tokens": 1890, "duplicate_conversation": 4}}
    (tmp_path / "prepared" / "dflash_data.json").write_text(json.dumps({"format": "dflash-prepared-v1", "counts": counts}))
    write_report(tmp_path / "eval" / "main-b16.json", 16, {"humaneval": result(5.5, True)})
    assert main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "data: 51,354 chats kept of 53,248 answers, 15,948,806 tokens (10,882,099 supervised); "
        "dropped: duplicate_conversation 4, too_few_supervised_tokens 1,890")


def test_a_missing_folder_is_one_line_and_help_is_help(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a folder: give a recipe's OUT folder" in err
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0 and "RUN_DIR" in capsys.readouterr().out.upper()


def test_a_temperature_sweep_adds_tau_and_its_share_of_greedy_at_each_temperature(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The τ column stays the report's own figure, the sweep's lowest temperature; each temperature above 0 of
    any sweep gets a column of τ there with its share of the greedy τ, and a report of one temperature beside it
    shows a dash there."""
    sweep = sweep_section([0.0, 0.7, 1.0], {"humaneval": [4.0, 3.6, 3.2], "mt-bench": [3.2, 2.72, 2.4]})
    write_report(tmp_path / "eval" / "main-b16.json", 16, {"humaneval": result(4.0, True), "mt-bench": result(3.2, True)},
                 temperature_sweep=sweep)
    write_report(tmp_path / "eval" / "main-fp32.json", 16, {"humaneval": result(3.9, True)}, dtype="float32")
    assert main([str(tmp_path)]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert table[0].startswith("| run | block | batch | dtype | dataset | requests | τ | τ 95% CI | "
                               "τ T=0.7 (of greedy) | τ T=1 (of greedy) | τ̂ teacher-forced | lossless |")
    assert table[2].startswith("| main | 16 | 1 | bfloat16 | humaneval | 4 | 4.00 | — | 3.60 (90%) | 3.20 (80%) | 4.50 |")
    assert table[3].startswith("| main | 16 | 1 | bfloat16 | mt-bench | 4 | 3.20 | — | 2.72 (85%) | 2.40 (75%) | 3.70 |")
    assert table[4].startswith("| main | 16 | 1 | float32 | humaneval | 4 | 3.90 | — | — | — | 4.40 |")
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert [(p["temperature"], p["tau"], p["speedup"]) for p in rows[0]["temperature_sweep"]] == [
        (0.0, 4.0, 2.0), (0.7, 3.6, 1.8), (1.0, 3.2, 1.6)]
    assert rows[2]["temperature_sweep"] is None


def test_a_sweep_without_greedy_shows_tau_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without 0 in the sweep there is no greedy τ to share: the τ column is the lowest temperature's (0.7) and
    the column of 1 shows τ only."""
    sweep = sweep_section([0.7, 1.0], {"humaneval": [3.5, 3.0]})
    write_report(tmp_path / "eval" / "main-b16.json", 16, {"humaneval": result(3.5, False)}, temperature_sweep=sweep)
    assert main([str(tmp_path)]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert "| τ T=0.7 (of greedy) | τ T=1 (of greedy) |" in table[0]
    assert "| 3.50 | — | 3.50 | 3.00 |" in table[2]


def test_the_eval_commands_own_sweep_section_is_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The layout `dflash-train eval` writes (eval/sweep.py), not only the hand-written one, reaches the table."""
    runs = [eval_sweep.SweepRun(0.0, {"humaneval": result(4.0, True)}),
            eval_sweep.SweepRun(1.0, {"humaneval": result(3.0, False)})]
    write_report(tmp_path / "eval" / "main-b16.json", 16, runs[0].datasets,
                 temperature_sweep=eval_sweep.sweep_section(runs))
    assert main([str(tmp_path)]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert "| τ T=1 (of greedy) |" in table[0] and "| 4.00 | — | 3.00 (75%) |" in table[2]


def test_a_training_line_names_the_device_and_the_median_mfu_after_the_cold_start(tmp_path: Path,
                                                                                 capsys) -> None:  # noqa: ANN001
    """The trainer logs each resolved step's MFU and its checkpoints the device: the line gives the device and
    the median MFU of the steps after the first logged one (compilation makes that one's MFU meaningless)."""
    state = tmp_path / "train" / "main" / "checkpoints" / "step-00000050"
    state.mkdir(parents=True)
    (state / "trainer_state.json").write_text(json.dumps(
        {"step": 50, "train_seconds": 60, "first_step_seconds": 20.0, "device": "NVIDIA H100 80GB HBM3"}))
    mfus = (0.001, 0.14, 0.15, 0.12, 0.16)
    records = [{"split": "train", "step": 10 * (i + 1), "step_seconds": 0.05, "mfu": m} for i, m in enumerate(mfus)]
    (tmp_path / "train" / "main" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    write_report(tmp_path / "eval" / "main-b16.json", 16, {"humaneval": result(5.5, True)})
    assert main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "training: main: 50 steps in 1.0 min on NVIDIA H100 80GB HBM3, median step 0.05 s, MFU 15.0 % (median), "
        "first step 20 s (compilation included)")


def test_a_training_line_gives_the_steps_mfu_with_the_targets_pass(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Where the trainer logged the whole step's MFU (the target's pass counted), the line gives both medians."""
    state = tmp_path / "train" / "main" / "checkpoints" / "step-00000040"
    state.mkdir(parents=True)
    (state / "trainer_state.json").write_text(json.dumps({"step": 40, "train_seconds": 60, "first_step_seconds": 20.0}))
    pairs = ((0.001, 0.002), (0.08, 0.17), (0.09, 0.18), (0.07, 0.16))
    records = [{"split": "train", "step": 10 * (i + 1), "step_seconds": 0.05, "mfu": m, "step_mfu": s}
               for i, (m, s) in enumerate(pairs)]
    (tmp_path / "train" / "main" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    write_report(tmp_path / "eval" / "main-b16.json", 16, {"humaneval": result(5.5, True)})
    assert main([str(tmp_path)]) == 0
    assert ", MFU 8.0 % the drafter's, 17.0 % with the target's pass (medians), " in capsys.readouterr().out


def test_a_training_line_names_the_peak_its_mfu_was_divided_by(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The peak comes from the run's own records (FLOPs over seconds over MFU, per device), so two devices' MFU
    compare with their peaks beside them; the table names where a known peak's figure comes from."""
    state = tmp_path / "train" / "main" / "checkpoints" / "step-00000030"
    state.mkdir(parents=True)
    (state / "trainer_state.json").write_text(json.dumps(
        {"step": 30, "train_seconds": 60, "device": "NVIDIA H200", "num_processes": 2}))
    peak = 2 * 790e12  # two devices
    records = [{"split": "train", "step": 10 * (i + 1), "step_seconds": 0.05, "flops": f, "mfu": f / 0.05 / peak}
               for i, f in enumerate((1e12, 4e12, 5e12))]
    (tmp_path / "train" / "main" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    write_report(tmp_path / "eval" / "main-b16.json", 16, {"humaneval": result(5.5, True)})
    assert main([str(tmp_path)]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert ", MFU 6.3 % (median; of 790 TFLOP/s a device (measured)), " in line  # 5e12 / 0.05 s / (2 x 790e12)
    (state / "trainer_state.json").write_text(json.dumps({"step": 30, "train_seconds": 60, "device": "NVIDIA H100"}))
    assert main([str(tmp_path)]) == 0  # one device at 1,580: no table entry of that rate, so no source
    assert ", MFU 6.3 % (median; of 1580 TFLOP/s a device), " in capsys.readouterr().out


@pytest.mark.parametrize(("graphs", "said"), [
    ((1, 2, 3), ", the drafter's step from CUDA graphs (3 shapes)"),
    ((1, None, None), ", the drafter's CUDA graphs turned off during the run (its log says why)"),
    ((None, None, None), ""),
])
def test_a_training_line_says_whether_the_drafters_step_ran_from_graphs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], graphs: tuple[int | None, ...], said: str) -> None:
    """The trainer logs the shapes captured so far with each resolved step while the graphs are on: the line
    gives the last count, or says the graphs were turned off if the later records lack it."""
    state = tmp_path / "train" / "main" / "checkpoints" / "step-00000030"
    state.mkdir(parents=True)
    (state / "trainer_state.json").write_text(json.dumps({"step": 30, "train_seconds": 60, "first_step_seconds": 20.0}))
    records = [{"split": "train", "step": 10 * (i + 1), "step_seconds": 0.05,
                **({} if g is None else {"step_graphs": g})} for i, g in enumerate(graphs)]
    (tmp_path / "train" / "main" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    write_report(tmp_path / "eval" / "main-b16.json", 16, {"humaneval": result(5.5, True)})
    assert main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"training: main: 30 steps in 1.0 min, median step 0.05 s{said}, first step 20 s (compilation included)")
