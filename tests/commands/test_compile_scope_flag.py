"""`--compile-scope` of `dflash-train eval` and `regenerate` reaches the runtime's settings; with eval's
`--no-compile` it is a one-line error, as `--max-autotune` is."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dflash_train.cli import main
from dflash_train.commands import eval as eval_command
from dflash_train.commands import regenerate as regenerate_command
from dflash_train.target import TargetModel
from tests.helpers.tiny_models import make_tiny_target


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return make_tiny_target("qwen3", num_layers=2, seed=1)


def parse(module: object, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)  # type: ignore[attr-defined]
    return parser.parse_args(argv)


@pytest.mark.parametrize("scope", ["step", "layer"])
def test_eval_flag_reaches_the_engine_settings(target: TargetModel, scope: str) -> None:
    args = parse(eval_command, ["--target", "t", "--draft", "random", "--dataset", "humaneval",
                                "--compile-scope", scope])
    assert eval_command._runtime_config(args, target, block_size=4, batch_size=1).compile_scope == scope


@pytest.mark.parametrize("scope", ["step", "layer"])
def test_regenerate_flag_reaches_the_engine_settings(target: TargetModel, scope: str, tmp_path: Path) -> None:
    args = parse(regenerate_command, ["--target", "t", "--out", str(tmp_path), "--data", "x.jsonl",
                                      "--compile-scope", scope])
    assert regenerate_command._runtime_config(args, target).compile_scope == scope


def test_default_is_one_layer(target: TargetModel) -> None:
    args = parse(eval_command, ["--target", "t", "--draft", "random", "--dataset", "humaneval"])
    assert eval_command._runtime_config(args, target, block_size=4, batch_size=1).compile_scope == "layer"
    args = parse(regenerate_command, ["--target", "t", "--data", "d", "--out", "o"])
    assert regenerate_command._runtime_config(args, target).compile_scope == "layer"


def test_no_compile_alone_is_accepted(target: TargetModel) -> None:
    # The default scope is not a choice the user made: --no-compile alone must not trip the scope check.
    args = parse(eval_command, ["--target", "t", "--draft", "random", "--dataset", "humaneval", "--no-compile"])
    eval_command._validate(args)
    assert eval_command._runtime_config(args, target, block_size=4, batch_size=1).compile is False


def test_layer_scope_without_compiling_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--target", str(tmp_path / "absent"), "--draft", "random", "--dataset", "humaneval",
                 "--compile-scope", "layer", "--no-compile", "--no-progress", "--out", str(tmp_path / "r.json")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("dflash-train eval: error:") and "drop --no-compile or --compile-scope" in last


def test_an_unknown_scope_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(eval_command, ["--target", "t", "--draft", "random", "--dataset", "humaneval", "--compile-scope", "model"])
    assert "invalid choice: 'model'" in capsys.readouterr().err
