"""Minutes per stage of two recipe runs side by side, against the first's (`recipes.scoring.stages`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipes.scoring.stages import compare, main


def run_folder(path: Path, times: str, gpus: int | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "times.tsv").write_text(times)
    if gpus is not None:
        state = path / "train" / "main" / "checkpoints" / "step-00000100"
        state.mkdir(parents=True)
        (state / "trainer_state.json").write_text(json.dumps({"step": 100, "num_processes": gpus}))
    return path


@pytest.fixture
def two_runs(tmp_path: Path) -> tuple[Path, Path]:
    one = run_folder(tmp_path / "speedrun", "prompts\t95\nregenerate\t277\nprepare\t44\ntrain\t527\neval\t381\n"
                                            "curve\t900\n", gpus=1)
    # regeneration killed once and resumed: two lines of one stage
    eight = run_folder(tmp_path / "speedrun-8gpu", "prompts\t96\nregenerate\t40\nregenerate\t20\nprepare\t44\n"
                                                  "train\t527\neval\t381\n", gpus=8)
    return one, eight


def test_each_stage_against_the_first_run(two_runs: tuple[Path, Path]) -> None:
    result = compare(list(two_runs))
    base, eight = result["runs"]
    assert (base["gpus"], eight["gpus"]) == (1, 8)
    assert eight["minutes"]["regenerate"] == pytest.approx(1.0)  # 40 + 20 seconds
    assert eight["speedup"]["regenerate"] == pytest.approx(277 / 60)
    # the total leaves the curve stage out: 1,324 s against 1,108 s
    assert base["minutes"]["total"] == pytest.approx(1324 / 60)
    assert eight["speedup"]["total"] == pytest.approx(1324 / 1108)
    assert "curve" not in eight["speedup"]  # a stage the other run did not run has no ratio


def test_main_prints_one_table_and_writes_json(two_runs: tuple[Path, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "stages.json"
    assert main([*map(str, two_runs), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| stage | speedrun (1 GPU) | speedrun-8gpu (8 GPUs) |" in printed
    assert "| regenerate | 4.6 | 1.0 (4.62×) |" in printed
    assert "| curve | 15.0 | — |" in printed
    assert "| total (without curve, ablate) | 22.1 | 18.5 (1.19×) |" in printed
    assert json.loads(out.read_text())["baseline"] == str(two_runs[0])


def test_bad_folders_and_lines_are_one_line_errors(two_runs: tuple[Path, Path], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(two_runs[0]), str(tmp_path / "nowhere")]) == 2
    assert "no times.tsv in" in capsys.readouterr().err
    for bad in ("train 527\n", "\t60\n", "train\tlong\n", "train\tnan\n"):
        broken = run_folder(tmp_path / f"broken-{len(list(tmp_path.iterdir()))}", "prompts\t95\n" + bad)
        assert main([str(two_runs[0]), str(broken)]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "line 2 is not 'stage<TAB>seconds'" in err, bad
