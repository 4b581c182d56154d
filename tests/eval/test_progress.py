"""`eval` in a job log: plain progress lines where output goes to a file (rich draws its bars only on a terminal),
and one warning line when the drafter was trained with another target than the one given."""

from __future__ import annotations

import io
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console
from rich.progress import Progress

from dflash_train.cli import main
from dflash_train.eval.console import PassProgress
from tests.helpers.training import save_tiny_target

LINE = re.compile(r"eval humaneval dflash: (\d+)/45 requests, [\d,]+ tok/s, τ (\d\.\d\d) \(\d+ s\)")


def run_pass(progress: Progress, total: int = 45) -> None:
    bar = PassProgress(progress, "humaneval dflash", total)
    for index in range(total):
        bar.finished(index, SimpleNamespace(tokens=[1] * 8, acceptance_lengths=[1, 3] if index % 2 else [2]))


def test_a_pass_logged_to_a_file_prints_plain_lines(capsys: pytest.CaptureFixture[str]) -> None:
    with Progress(console=Console(file=io.StringIO())) as progress:  # not a terminal: a file or a pipe
        run_pass(progress)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "eval humaneval dflash: 45 requests"
    matches = [LINE.fullmatch(line) for line in lines[1:]]
    assert all(matches), lines
    assert [int(m.group(1)) for m in matches] == [5, 10, 15, 20, 25, 30, 35, 40, 45]  # every 10 %, and the end
    assert matches[-1].group(2) == "2.00"  # the running τ: mean over requests of each one's mean a+1


def test_lines_are_at_most_twenty_requests_apart(capsys: pytest.CaptureFixture[str]) -> None:
    with Progress(console=Console(file=io.StringIO())) as progress:
        run_pass(progress, total=500)
    done = [int(line.split(": ")[1].split("/")[0]) for line in capsys.readouterr().out.splitlines()[1:]]
    assert done == list(range(20, 501, 20))


def test_a_terminal_gets_the_bar_only(capsys: pytest.CaptureFixture[str]) -> None:
    with Progress(console=Console(file=io.StringIO(), force_terminal=True)) as progress:
        run_pass(progress)
    assert capsys.readouterr().out == ""
    run_pass(None)  # --no-progress
    assert capsys.readouterr().out == ""


# ------------------------------------------------------------------------------------ the drafter's target


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("targets")
    return {"a": save_tiny_target(root / "a", seed=0), "b": save_tiny_target(root / "b", seed=1)}


def drafter_trained_with(target_dir: Path, out: Path) -> Path:
    """A drafter checkpoint recording `target_dir`'s fingerprint, as training writes it."""
    import torch

    from dflash_train.checkpoint import save_draft
    from dflash_train.models import DFlashConfig, DFlashDraftModel
    from dflash_train.target import load_target, target_fingerprint

    target = load_target(str(target_dir), dtype=torch.float32)
    config = DFlashConfig.from_target_config(target.config, mask_token_id=0, num_hidden_layers=1, block_size=4)
    meta = {"step": 3, "target": str(target_dir), "target_fingerprint": target_fingerprint(target.model)}
    return save_draft(DFlashDraftModel(config), out, extra_config={"dflash_train": meta})


def evaluate(target_dir: Path, draft: Path, out: Path) -> int:
    return main(["eval", "--target", str(target_dir), "--draft", str(draft), "--dataset", "humaneval",
                 "--num-prompts", "2", "--max-new-tokens", "4", "--device", "cpu", "--dtype", "float32",
                 "--no-compile", "--no-plot", "--out", str(out / "report.json")])


def test_eval_warns_when_the_drafter_was_trained_with_another_target(targets: dict[str, Path], tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    draft = drafter_trained_with(targets["a"], tmp_path / "draft")
    assert evaluate(targets["b"], draft, tmp_path) == 0  # a warning, not an error
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"dflash-train eval: warning: the drafter was trained with another target ({targets['a']}) than "
        f"{targets['b']} (target fingerprint v")
    assert "pass the target it was trained with" in warnings[0]
    # Its output went to a file here (captured): plain lines, a start line and the end line of each pass
    assert "eval humaneval target only: 2 requests" in captured.out
    assert re.search(r"eval humaneval dflash: 2/2 requests, [\d,]+ tok/s, τ \d\.\d\d", captured.out)


def test_eval_does_not_warn_for_the_drafter_own_target(targets: dict[str, Path], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    draft = drafter_trained_with(targets["a"], tmp_path / "draft")
    assert evaluate(targets["a"], draft, tmp_path) == 0
    assert "warning" not in capsys.readouterr().err
