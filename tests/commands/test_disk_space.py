"""A full disk is reported with the free space of the disk that holds the command's output, found from the
output path's nearest existing folder, not of the working directory's disk (the two often differ: outputs go
to a large scratch disk)."""

from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from dflash_train import disk
from dflash_train.cli import main
from dflash_train.commands import train
from tests.helpers.paths import REPO
from tests.helpers.training import save_tiny_target

RECIPE = REPO / "recipes" / "smollm2-135m-dflash-b16-cpu.yaml"
Usage = namedtuple("Usage", "total used free")
NO_SPACE = "Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space left on device\" })"


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`tmp_path/scratch` is a disk of its own with 1.5 GiB free; everything else has 900 GiB."""
    mount = tmp_path / "scratch"
    mount.mkdir()
    asked: list[Path] = []

    def disk_usage(path: str | Path) -> Usage:
        path = Path(path)
        assert path.exists(), f"disk_usage of a missing path: {path}"  # the real one would raise
        asked.append(path)
        free = 1.5 * 2**30 if path == mount or mount in path.parents else 900 * 2**30
        return Usage(1000 * 2**30, 0, int(free))

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    return mount


def test_free_space_is_that_of_the_nearest_existing_folder(scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert disk.free_gib(scratch / "runs" / "not" / "made" / "yet") == 1.5
    assert disk.free_gib(scratch.parent / "elsewhere") == 900
    monkeypatch.chdir(scratch)
    assert disk.free_gib(Path("runs/new")) == 1.5  # relative: from the working directory


def test_an_error_without_a_file_name_reports_the_output_folder_disk(scratch: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(scratch.parent)  # the working directory is on the large disk
    with disk.command_output():
        disk.note_output(scratch / "features")
        message = disk.disk_full_message(RuntimeError(NO_SPACE)) or ""
    assert message.startswith(f"disk full writing to {scratch / 'features'} (1.5 GiB free there): ")
    # Once the command is over its folder is forgotten: nothing run later is reported with it.
    assert disk.disk_full_message(RuntimeError(NO_SPACE)).startswith("disk full writing to the output: ")
    disk.note_output(scratch / "features")  # outside a command (a library call): not recorded
    assert disk.disk_full_message(RuntimeError(NO_SPACE)).startswith("disk full writing to the output: ")


def test_train_reports_the_free_space_of_its_output_dir(scratch: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    def fills_the_disk(config: object) -> None:
        raise RuntimeError(NO_SPACE)  # what torch's and safetensors' writers raise: no file name

    monkeypatch.setattr(train, "run_training", fills_the_disk)
    monkeypatch.chdir(scratch.parent)
    out = scratch / "runs" / "cpu"
    assert train.main(["--config", str(RECIPE), f"training.output_dir={out}"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"dflash-train train: error: disk full writing to {out} (1.5 GiB free there): free space or write to another "
        "disk; files already finished are intact, and the same command continues where it stopped")


def test_eval_reports_the_free_space_of_its_report_folder(scratch: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    def fills_the_disk(*args: object, **kwargs: object) -> None:
        raise RuntimeError(NO_SPACE)

    target = save_tiny_target(tmp_path / "target")
    monkeypatch.setattr("dflash_train.commands.eval.write_outputs", fills_the_disk)
    monkeypatch.chdir(scratch.parent)
    out = scratch / "eval" / "report.json"
    assert main(["eval", "--target", str(target), "--draft", "random", "--random-draft-layers", "1",
                 "--block-size", "4", "--dataset", "humaneval", "--num-prompts", "1", "--max-new-tokens", "4",
                 "--device", "cpu", "--no-compile", "--no-progress", "--out", str(out)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"dflash-train eval: error: disk full writing to {out.parent} (1.5 GiB free there): ")
