"""The speedrun-step benchmark: a run's figures from its metrics, the trees it accepts, and two short packed runs
of the same tree on a tiny target (CPU), their table and results file."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

from benchmarks import speedrun_step as bench
from tests.helpers.paths import CPU_RECIPE
from tests.helpers.training import overrides, save_tiny_prepared, save_tiny_target

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_figures_leave_out_the_first_log_and_take_medians(tmp_path: pathlib.Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000040").mkdir(parents=True)
    records = [{"step": 10, "split": "train", "step_seconds": 9.0, "step_mfu": 0.01}]  # the cold first log
    records += [{"step": 10 * i, "split": "train", "step_seconds": s, "step_mfu": m, "pack_anchor_fill": 0.98}
                for i, (s, m) in enumerate([(0.05, 0.30), (0.04, 0.33), (0.06, 0.28)], start=2)]
    records.append({"step": 40, "split": "validation", "expected_acceptance_length": 2.5})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (run / "checkpoints" / "step-00000040" / "trainer_state.json").write_text(json.dumps(
        {"step": 40, "sequences_seen": 1000, "train_seconds": 30.0, "first_step_seconds": 10.0, "device": "cpu"}))
    figures = bench.run_figures(run)
    assert figures["step_seconds"]["median"] == pytest.approx(0.05) and figures["step_mfu"]["median"] == 0.30
    assert figures["chats_per_second"] == pytest.approx(50.0) and figures["held_out_tau_hat"] == 2.5
    assert figures["pack_token_fill"] is None and len(figures["logged"]) == 3


def test_a_tree_must_be_a_checkout(tmp_path: pathlib.Path) -> None:
    with pytest.raises(SystemExit, match="holds no dflash_train package"):
        bench.parse_trees([f"old={tmp_path}"])
    assert bench.parse_trees([]) == [("this", pathlib.Path.cwd().resolve())]
    assert bench.parse_trees([str(REPO)]) == [(REPO.name, REPO)]


@pytest.mark.slow
def test_two_runs_of_this_tree_give_a_table_and_a_results_file(tmp_path: pathlib.Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assets = {"target": save_tiny_target(tmp_path / "target"), "data": save_tiny_prepared(tmp_path / "data",
                                                                                         num_rows=40)}
    tiny = [o for o in overrides(assets, tmp_path / "unused", **{"data.pack_tokens": 160, "training.max_steps": 4})
            if not o.startswith(("training.output_dir=", "model.target=", "data.prepared=",
                                 "training.save_every=", "training.eval_every="))]
    monkeypatch.setenv("DFLASH_BENCH_RESULTS", str(tmp_path / "results"))
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", ["speedrun_step"])
    bench.main(["--prepared", str(assets["data"]), "--target", str(assets["target"]), "--recipe", str(CPU_RECIPE),
                "--tree", f"a={REPO}", "--repeat", "2", "--minutes", "5", "--workdir", str(tmp_path / "work"),
                *[arg for o in tiny for arg in ("--set", o)]])
    results = json.loads((tmp_path / "results" / "speedrun_step.json").read_text())["results"]
    assert [r["name"] for r in results] == ["a", "a (again)"]
    for r in results:
        assert "error" not in r, r
        assert r["steps"] == 4 and r["packing"].startswith("packing:") and r["pack_anchor_fill"]["median"] > 0
    out = capsys.readouterr().out
    assert "a (again)" in out and "1.000x" in out
