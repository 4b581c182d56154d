"""`regenerate --stop-loops` reaches the runtime's settings and the run's recorded settings (so a resume must
match it), stays off by default, and with a server back end is a one-line error before anything loads."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dflash_train.cli import main
from dflash_train.commands import regenerate as regenerate_command
from dflash_train.target import TargetModel
from tests.helpers.tiny_models import make_tiny_target


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return make_tiny_target("llama", num_layers=2, seed=1)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    regenerate_command.add_arguments(parser)
    return parser.parse_args(["--target", "t", "--data", "d.jsonl", "--out", "o", *argv])


def test_the_flag_reaches_the_runtime_and_the_recorded_settings(target: TargetModel) -> None:
    on, off = parse(["--stop-loops"]), parse([])
    assert regenerate_command._runtime_config(on, target).stop_loops is True
    assert regenerate_command._runtime_config(off, target).stop_loops is False
    assert regenerate_command._recorded(on)["stop_loops"] is True
    assert "stop_loops" not in regenerate_command._recorded(off)  # earlier runs' manifests still resume


def test_with_a_server_it_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    assert main(["regenerate", "--target", str(tmp_path / "absent"), "--data", str(data), "--out",
                 str(tmp_path / "out"), "--server-url", "http://127.0.0.1:9/v1", "--stop-loops"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("--stop-loops works in the built-in back end only: leave it out with --server-url")
    assert not (tmp_path / "out").exists()
