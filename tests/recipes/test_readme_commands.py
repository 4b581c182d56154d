"""The README's shell commands, read from its ```bash blocks and run in the order it gives them, in a folder laid
out like a fresh clone (its `recipes/` and `data/`, nothing written yet): each command must find what the ones
before it wrote. They run on the real SmolLM2-135M-Instruct, on the CPU, at tiny sizes:

- `dflash-train ...` (or `.venv/bin/dflash-train ...`) runs in this process with the flags of `TINY` appended for
  its subcommand (argparse keeps a flag's last value, and a later training override wins), so that sizes shrink
  while paths, targets and step counts stay those of the README;
- a command whose comment names GPUs (`# one GPU`, `# DDP, 8 GPUs`: `python -m dflash_train.train`,
  `accelerate launch ... -m dflash_train.train`) is not run here: its recipe and overrides must load, its
  launch config exist and the data it trains on exist at that point of the sequence;
- `make TARGET` must name a target of the Makefile (make builds the environment this test runs in, and
  `make test` would run this test); `source .venv/bin/activate` is that environment.

Any other command fails the test: a README command it cannot check is one nobody checks.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.markers import needs_smollm2
from tests.helpers.paths import REPO

README = REPO / "README.md"
CONSOLE_SCRIPTS = ("dflash-train", ".venv/bin/dflash-train")
# Appended to the README's own flags: the same commands, small enough for a CPU test.
TINY = {
    "regenerate": ["--max-samples", "6", "--max-new-tokens", "48"],
    "train": ["model.num_draft_layers=1", "data.max_length=128", "training.batch_size=1", "training.num_anchors=8"],
    "eval": ["--num-prompts", "1", "--max-new-tokens", "8"],
}


@dataclass(frozen=True)
class Command:
    argv: list[str]
    comment: str  # the trailing comment of its last line
    line: int  # where it starts in the README

    def __str__(self) -> str:
        return f"README.md:{self.line}: {shlex.join(self.argv)}"


def bash_blocks(text: str) -> Iterator[list[tuple[int, str]]]:
    """The lines (number, text without the block's indentation) of every ```bash block, in order; blocks
    inside list items are indented."""
    block: list[tuple[int, str]] | None = None
    indent = 0
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if block is None and stripped == "```bash":
            block, indent = [], len(line) - len(line.lstrip())
        elif block is not None and stripped == "```":
            yield block
            block = None
        elif block is not None:
            block.append((number, line[indent:]))


def readme_commands(text: str) -> list[Command]:
    """Every command of the README's bash blocks: continuation lines joined, comment lines dropped."""
    commands = []
    for block in bash_blocks(text):
        pending: list[str] = []
        start = 0
        for number, line in block:
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            start = start if pending else number
            if line.rstrip().endswith("\\"):
                pending.append(line.rstrip()[:-1])
                continue
            code, _, comment = " ".join([*pending, line]).partition(" #")
            commands.append(Command(shlex.split(code), comment.strip(), start))
            pending = []
        assert not pending, f"README.md:{start}: a command continues past the end of its block"
    return commands


def test_the_readme_is_parsed_into_its_commands() -> None:
    """The parsing itself, on a block like the README's (a check that would pass on no commands checks nothing)."""
    text = ("intro\n```bash\n# a comment\nmake demo\n```\n- item:\n  ```bash\n  a --x 1 \\\n      --y 'two words'"
            "   # one GPU\n  ```\n```python\nnot = 'bash'\n```\n")
    assert [(c.argv, c.comment, c.line) for c in readme_commands(text)] == [
        (["make", "demo"], "", 4), (["a", "--x", "1", "--y", "two words"], "one GPU", 8)]
    assert len(readme_commands(README.read_text())) >= 15


@pytest.fixture
def clone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder with what a fresh clone has that the commands read (the recipes and the bundled data), as the
    working directory."""
    for name in ("recipes", "data"):
        (tmp_path / name).symlink_to(REPO / name, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.slow
@needs_smollm2
def test_the_readme_commands_run_in_order_from_a_fresh_clone(clone: Path) -> None:
    commands = readme_commands(README.read_text())
    ran = []
    for command in commands:
        program = command.argv[0]
        if program in CONSOLE_SCRIPTS:
            run_console_script(command)
            ran.append(command.argv[1])
        elif program == "make":
            check_make_target(command)
        elif "GPU" in command.comment:
            check_gpu_launch(command)
        elif command.argv == ["source", ".venv/bin/activate"]:
            continue  # the environment this test runs in
        else:
            pytest.fail(f"{command}: a README command this test cannot check; teach it how")
    # The whole job ran, in the README's order: the data, a drafter trained on it, evaluated, exported, checked,
    # then fine-tuned from its export.
    assert ran == ["inspect", "regenerate", "prepare", "train", "eval", "eval", "export", "check", "push", "train"]
    assert (clone / "runs" / "exports" / "SmolLM2-135M-DFlash-b16" / "model.safetensors").is_file()
    # Everything the commands wrote is under folders that .gitignore keeps out of a clone's status.
    written = {path.name for path in clone.iterdir()} - {"recipes", "data"}
    assert written <= {"runs", "outputs"}, f"the README's commands wrote {sorted(written)} outside runs/ and outputs/"
    ignored = set((REPO / ".gitignore").read_text().split())
    assert {"/runs/", "outputs/"} <= ignored


def run_console_script(command: Command) -> None:
    from dflash_train.cli import main

    subcommand = command.argv[1]
    code = main([*command.argv[1:], *TINY.get(subcommand, [])])
    assert code == 0, f"{command}: exit status {code}"


def check_gpu_launch(command: Command) -> None:
    """A launch that needs GPUs: its accelerate config, recipe and overrides load, and its data exist now."""
    from dflash_train.commands.train import add_arguments
    from dflash_train.training.config import load_config

    argv = command.argv
    if argv[:2] == ["accelerate", "launch"]:
        config_file = argv[argv.index("--config_file") + 1]
        assert Path(config_file).is_file(), f"{command}: no {config_file}"
    assert "dflash_train.train" in argv, f"{command}: only training launches are known to need GPUs"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv[argv.index("dflash_train.train") + 1:])
    config = load_config(args.config, args.overrides)
    data = config.data.features or config.data.prepared
    assert data and Path(data).exists(), f"{command}: trains on {data}, which no command before it wrote"


def check_make_target(command: Command) -> None:
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), flags=re.MULTILINE))
    named = [arg for arg in command.argv[1:] if "=" not in arg]
    assert named and set(named) <= targets, f"{command}: the Makefile has no target {named}"
