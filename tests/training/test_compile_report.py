"""The first step's torch.compile time is reported (a cold compile of a wide drafter takes minutes)."""

from __future__ import annotations

import pathlib

import pytest

from dflash_train.training.compile_report import first_step_line
from dflash_train.training.config import load_config
from dflash_train.training.trainer import run_training
from tests.helpers.training import overrides


def test_first_step_line_splits_compile_from_the_rest() -> None:
    line = first_step_line(225.4, {"forward": 1.0, "backward": 0.5}, {"forward": 121.3, "backward": 80.3})
    assert line == "first step 225.4 s: torch.compile 200.1 s (forward 120.3, backward 79.8), the rest 25.3 s"
    assert first_step_line(0.4, {"forward": 3.0, "backward": 1.0}, {"forward": 3.2, "backward": 1.1}) is None
    assert first_step_line(5.0, {}, {}) is None  # dynamo's timers unavailable: no line


@pytest.mark.slow
def test_a_compiled_run_reports_its_first_step(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                               capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._dynamo

    from dflash_train.training import compile_report

    # A tiny drafter compiles in about a second, less after other compiled tests in the same process:
    # report any compile time, so that the line's presence does not depend on what ran before.
    monkeypatch.setattr(compile_report, "MIN_SECONDS", 0.0)
    torch._dynamo.reset()
    run_training(load_config(None, overrides(assets, tmp_path / "run", **{
        "training.max_steps": 2, "training.compile": True, "training.eval_every": 0})))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("first step ")]
    assert len(lines) == 1 and "torch.compile" in lines[0], lines
    compiled = float(lines[0].split("torch.compile ")[1].split(" s")[0])
    assert compiled > 0


def test_the_first_step_says_which_path_the_varlen_kernel_took(assets: dict[str, pathlib.Path],
                                                                tmp_path: pathlib.Path,
                                                                capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the target's varlen attention asked its kernel about grouped heads (only on CUDA), the first step's
    log carries the answer, once (off CUDA nothing asks: a stand-in report here)."""
    from dflash_train.training import trainer

    said = "varlen attention on cuda:0: 3 key/value heads for 9 query heads of 64 (bfloat16) passed as they are"
    monkeypatch.setattr(trainer, "grouped_heads_report", lambda: [said])
    run_training(load_config(None, overrides(assets, tmp_path / "run", **{
        "training.max_steps": 3, "training.eval_every": 0, "training.log_every": 1})))
    assert capsys.readouterr().out.splitlines().count(said) == 1
