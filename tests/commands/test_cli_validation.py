"""Counts and sizes that cannot work (a batch of 0 rows, a window of 0 shards) are refused while the command line
is read, in one line naming the flag, before anything loads: not as an error from deep inside the run."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_train.cli import main
from tests.helpers.paths import REPO
from tests.helpers.training import save_tiny_prepared, save_tiny_target

PROMPTS = REPO / "data" / "prompts" / "demo_prompts.jsonl"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inputs")
    return {"target": save_tiny_target(root / "target"), "prepared": save_tiny_prepared(root / "prepared", num_rows=4)}


def command(name: str, inputs: dict[str, Path], out: Path) -> list[str]:
    """A command line that runs as it is (small, on the CPU): only the flag under test makes it wrong."""
    target = str(inputs["target"])
    if name == "regenerate":
        return ["regenerate", "--target", target, "--data", str(PROMPTS), "--max-samples", "4", "--max-new-tokens",
                "4", "--device", "cpu", "--dtype", "fp32", "--out", str(out)]
    if name == "prepare":
        return ["prepare", "--target", target, "--data", str(PROMPTS), "--out", str(out)]
    if name == "extract":
        return ["extract", "--target", target, "--data", str(inputs["prepared"]), "--device", "cpu",
                "--target-dtype", "fp32", "--out", str(out)]
    return ["eval", "--target", target, "--draft", "random", "--random-draft-layers", "1", "--dataset", "humaneval",
            "--num-prompts", "1", "--max-new-tokens", "4", "--device", "cpu", "--no-compile", "--no-progress",
            "--no-plot", "--out", str(out / "report.json")]


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(("name", "flag", "least"), [
    ("regenerate", "--batch-size", 1), ("regenerate", "--max-new-tokens", 1), ("regenerate", "--max-samples", 1),
    ("regenerate", "--max-prompt-tokens", 1), ("regenerate", "--concurrency", 1), ("regenerate", "--world-size", 1),
    ("regenerate", "--rank", 0), ("regenerate", "--decode-rows", 1),
    ("extract", "--window-shards", 1), ("extract", "--token-budget", 1), ("extract", "--rows-per-shard", 1),
    ("extract", "--write-threads", 1), ("extract", "--num-draft-layers", 1), ("extract", "--world-size", 1),
    ("extract", "--recompute", 0),
    ("eval", "--batch-size", 1), ("eval", "--max-new-tokens", 1), ("eval", "--num-prompts", 1),
    ("eval", "--block-size", 1), ("eval", "--random-draft-layers", 1),
    ("prepare", "--max-length", 1), ("prepare", "--block-size", 1), ("prepare", "--show", 1),
    ("regenerate", "--samples-per-prompt", 1),
])
def test_a_count_below_its_least_is_one_line_naming_the_flag(name: str, flag: str, least: int,
                                                            inputs: dict[str, Path], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main([*command(name, inputs, out), flag, str(least - 1)]) == 2
    assert one_line_error(capsys) == (f"dflash-train {name}: error: argument {flag}: must be at least {least}, "
                                      f"not {least - 1} (see dflash-train {name} --help)")
    assert not out.exists()  # refused before anything was written


@pytest.mark.parametrize(("name", "flag", "value", "message"), [
    ("regenerate", "--batch-size", "eight", "must be an integer >= 1, not 'eight'"),
    ("extract", "--shard-gb", "0", "must be > 0, not 0"),
    ("extract", "--shard-gb", "nan", "must be > 0, not nan"),
    ("extract", "--shard-gb", "big", "must be a number > 0, not 'big'"),
])
def test_a_value_that_is_not_a_count_or_size_is_one_line(name: str, flag: str, value: str, message: str,
                                                         inputs: dict[str, Path], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command(name, inputs, tmp_path / "out"), flag, value]) == 2
    assert one_line_error(capsys).startswith(f"dflash-train {name}: error: argument {flag}: {message}")


def test_any_refused_command_line_is_one_line_and_exit_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse's own refusals too: the usage text would come first, burying the line that matters."""
    assert main(["eval", "--target", "x"]) == 2
    assert one_line_error(capsys) == ("dflash-train eval: error: the following arguments are required: --draft, "
                                      "--dataset (see dflash-train eval --help)")
    assert main(["nope"]) == 2
    assert one_line_error(capsys).startswith("dflash-train: error: argument COMMAND: invalid choice: 'nope'")


def test_a_command_run_alone_refuses_in_one_line_too(capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m dflash_train.commands.eval ...` parses as `dflash-train eval` does."""
    from dflash_train.commands import eval as eval_command

    assert eval_command.main(["--target", "x", "--draft", "random", "--dataset", "humaneval", "--batch-size", "0"]) == 2
    assert one_line_error(capsys) == ("dflash-train eval: error: argument --batch-size: must be at least 1, not 0 "
                                      "(see dflash-train eval --help)")
