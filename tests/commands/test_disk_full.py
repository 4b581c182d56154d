"""A full disk in any command: one line that says what to do, finished files intact, and the same command
continues (checked end to end on `regenerate`, whose shards are the long-running output)."""

from __future__ import annotations

import errno
import os
import pathlib
from collections.abc import Callable

import pytest

import dflash_train.regeneration.regenerate as regenerate_module
from dflash_train import cli
from dflash_train.atomic import write_atomically
from dflash_train.commands import train
from dflash_train.disk import disk_full_message
from dflash_train.shards import regenerated_files
from tests.helpers.paths import REPO
from tests.helpers.training import save_tiny_target


def no_space(path: pathlib.Path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def test_disk_full_is_recognised_however_a_library_words_it() -> None:
    assert disk_full_message(no_space(pathlib.Path("/nonexistent/x.bin"))) is not None
    rust = RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                        '"No space left on device" })')  # safetensors
    assert "disk full writing to the output" in (disk_full_message(rust) or "")
    assert disk_full_message(OSError(errno.EACCES, "Permission denied", "/x")) is None
    assert disk_full_message(RuntimeError("shape mismatch")) is None


def test_regenerate_on_a_full_disk_stops_cleanly_and_resumes(tmp_path: pathlib.Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    target = save_tiny_target(tmp_path / "target")
    command = ["regenerate", "--target", str(target), "--data", str(REPO / "data/prompts/demo_prompts.jsonl"),
               "--max-samples", "12", "--max-new-tokens", "8", "--batch-size", "4", "--dtype", "fp32",
               "--device", "cpu"]
    assert cli.main([*command, "--out", str(tmp_path / "clean")]) == 0
    writes = {"count": 0}

    def filling_disk(path: pathlib.Path, write: Callable[[pathlib.Path], None]) -> None:
        writes["count"] += 1
        if writes["count"] < 2:
            return write_atomically(path, write)

        def partial(tmp: pathlib.Path) -> None:  # the disk fills half-way through the second shard
            tmp.write_text('{"row_id": ')
            raise no_space(tmp)

        return write_atomically(path, partial)

    monkeypatch.setattr(regenerate_module, "write_atomically", filling_disk)
    out = tmp_path / "full"
    capsys.readouterr()
    assert cli.main([*command, "--out", str(out)]) == 2
    error = capsys.readouterr().err.split("\n")[-2]  # a line of its own, after the closed progress bar
    assert error.startswith(f"dflash-train regenerate: error: disk full writing to {out} (") and "GiB free" in error
    assert "the same command continues" in error
    assert [p.name for p in regenerated_files(out)] == ["part-000000.jsonl"]
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp"))  # no half-written shard left
    monkeypatch.undo()  # room again: the same command finishes, with the rows of an uninterrupted run
    assert cli.main([*command, "--out", str(out)]) == 0
    clean = {p.name: p.read_text() for p in regenerated_files(tmp_path / "clean")}
    assert {p.name: p.read_text() for p in regenerated_files(out)} == clean and len(clean) == 3


def test_train_on_a_full_disk_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                          tmp_path: pathlib.Path) -> None:
    def fails(args: object) -> int:
        raise no_space(tmp_path / "run" / "metrics.jsonl")

    monkeypatch.setattr(train, "run", fails)
    assert train.main(["--config", "recipes/smollm2-135m-dflash-b16-cpu.yaml"]) == 2
    assert capsys.readouterr().err.startswith(f"dflash-train train: error: disk full writing to {tmp_path}/run (")


def test_an_eval_report_cut_short_leaves_no_report(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipe skips an evaluation whose report exists: a half-written one must never be there."""
    import dflash_train.shards as shards
    from dflash_train.eval.report import write_outputs

    def full_disk(source: str, destination: str) -> None:
        raise no_space(pathlib.Path(destination))

    monkeypatch.setattr(shards.os, "replace", full_disk)
    out = tmp_path / "eval" / "main-b16.json"
    with pytest.raises(OSError):
        write_outputs({"datasets": {}}, out, plot=False)
    assert list((tmp_path / "eval").iterdir()) == []  # neither the report nor a temporary file
    monkeypatch.undo()
    assert write_outputs({"datasets": {}}, out, plot=False) == [out] and out.read_text().startswith("{")
