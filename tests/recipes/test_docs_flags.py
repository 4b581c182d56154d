"""Every `dflash-train COMMAND --flag` and `python -m benchmarks.NAME --flag` the docs show (README.md and docs/*.md,
code blocks and inline code; the benchmarks' docstrings and the recipe scripts too) names a flag that the command's parser takes, and
every `section.key=value` override shown after `dflash-train train` or
`python -m dflash_train.train` names a field of the training config. The README's commands also run
(test_readme_commands.py); the other docs' commands are too many and too large to run, so their flags are checked
against the parsers here, where a renamed flag would otherwise leave a doc that fails in a user's hands."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash_train.cli import COMMANDS, build_parser
from dflash_train.training.config import TrainConfig
from tests.helpers.paths import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BENCHMARKS = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py") if p.stem != "__init__")
# `python -m MODULE --flag` commands whose parser is checked: every benchmark, and the package's module commands.
MODULE_COMMANDS = {f"benchmarks.{name}" for name in BENCHMARKS} | {
    "dflash_train.prompts.pack", "dflash_train.demo", "recipes.scoring.curve", "dflash_train.eval.served",
    "recipes.scoring.summary", "recipes.scoring.compare"}
CONSOLE_SCRIPTS = {"dflash-train", ".venv/bin/dflash-train", "dflash_train.cli"}  # the last after -m
TRAIN_MODULE = "dflash_train.train"
OVERRIDE = re.compile(r"^([a-z_]+)\.([a-z_0-9]+)=")


def shell_snippets(text: str) -> Iterator[str]:
    """The text of every fenced code block and every inline code span, line continuations joined."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    outside = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    for block in fenced:
        yield from block.replace("\\\n", " ").splitlines()
    yield from re.findall(r"`([^`\n]+)`", outside)


def invocations(snippet: str) -> Iterator[tuple[str, list[str]]]:
    """(command, its words) of each `dflash-train COMMAND ...`, `... -m dflash_train.train ...` or `python -m MODULE
    ...` (MODULE_COMMANDS) in a snippet,
    cut at pipes, `&&`, `;` and comments; a snippet that is not shell (unbalanced quotes) yields nothing."""
    for part in re.split(r"\|\||&&|[|;]|\s#\s", snippet):
        try:
            words = shlex.split(part)
        except ValueError:
            continue
        for i, word in enumerate(words):
            if word in CONSOLE_SCRIPTS and i + 1 < len(words) and words[i + 1] in COMMANDS:
                yield words[i + 1], words[i + 2:]
            elif word == TRAIN_MODULE and i > 0 and words[i - 1] == "-m":
                yield "train", words[i + 1:]
            elif word in MODULE_COMMANDS and i > 0 and words[i - 1] == "-m":
                yield word, words[i + 1:]


def script_as_markdown(script: str) -> str:
    """A shell script as the reader reads docs: its commands a code block, its comment lines prose (whose inline
    code is read as such)."""
    lines = script.splitlines()
    comments = [line for line in lines if line.lstrip().startswith("#")]
    commands = [line for line in lines if not line.lstrip().startswith("#")]
    return "```\n" + "\n".join(commands) + "\n```\n" + "\n".join(comments) + "\n"


def shown_invocations() -> list[tuple[str, str, list[str]]]:
    """(document, command, words) of every invocation the docs show; a benchmark's docstring counts as a doc."""
    texts = {doc.relative_to(REPO).as_posix(): doc.read_text() for doc in DOCS}
    texts |= {f"benchmarks/{name}.py": "```\n" + (importlib.import_module(f"benchmarks.{name}").__doc__ or "") + "```\n"
              for name in BENCHMARKS}
    texts |= {script.relative_to(REPO).as_posix(): script_as_markdown(script.read_text())
              for script in sorted((REPO / "recipes").glob("*.sh"))}
    return [(doc, command, words) for doc, text in texts.items()
            for snippet in shell_snippets(text) for command, words in invocations(snippet)]


class _Captured(Exception):  # noqa: N818 (not an error: how the parser comes out of main())
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def module_parser(name: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser a module command's main() builds, caught as it parses (before anything runs)."""
    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Captured(self)

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", capture)
        try:
            importlib.import_module(name).main()
        except _Captured as caught:
            return caught.parser
    raise AssertionError(f"{name}.main() parsed no arguments")


def command_flags(command: str, monkeypatch: pytest.MonkeyPatch) -> set[str]:
    if command in MODULE_COMMANDS:
        return set(module_parser(command, monkeypatch)._option_string_actions)
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices[command]._option_string_actions)


def config_fields() -> set[str]:
    config = TrainConfig()
    return {f"{section.name}.{field.name}" for section in dataclasses.fields(config)
            for field in dataclasses.fields(getattr(config, section.name))}


def test_the_docs_show_commands_of_every_kind() -> None:
    """The reader finds what it checks: a change in how the docs write commands would otherwise pass unseen."""
    shown = shown_invocations()
    assert {command for _, command, _ in shown} >= {"train", "eval", "export", "prepare", "regenerate", "extract",
                                                    "benchmarks.decode", "benchmarks.decode_batch",
                                                    "dflash_train.prompts.pack", "recipes.scoring.summary"}
    assert sum(1 for _, command, words in shown if command == "train" and any(OVERRIDE.match(w) for w in words)) > 3


def test_every_flag_the_docs_show_is_one_the_command_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    shown = shown_invocations()
    flags = {command: command_flags(command, monkeypatch) for command in {command for _, command, _ in shown}}
    wrong = sorted({f"{doc}: {command} {word.split('=')[0]}" for doc, command, words in shown
                    for word in words if word.startswith("--") and word.split("=")[0] not in flags[command]})
    assert not wrong, "\n".join(wrong)


def test_every_override_the_docs_show_is_a_config_field() -> None:
    fields = config_fields()
    wrong = sorted({f"{doc}: {word.split('=')[0]}" for doc, command, words in shown_invocations() if command == "train"
                    for word in words if OVERRIDE.match(word) and word.split("=")[0] not in fields})
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("snippet, expected", [
    ("dflash-train eval --target T --draft D | tee log", [("eval", ["--target", "T", "--draft", "D"])]),
    ("accelerate launch -m dflash_train.train recipes/x.yaml training.lr=1e-4",
     [("train", ["recipes/x.yaml", "training.lr=1e-4"])]),
    ("echo 'unbalanced", []),
    ("dflash-train nonsense --x", []),
    ("python -m benchmarks.decode --section smollm2  # a GPU", [("benchmarks.decode", ["--section", "smollm2"])]),
])
def test_the_reader_finds_invocations(snippet: str, expected: list[tuple[str, list[str]]]) -> None:
    assert list(invocations(snippet)) == expected


def test_the_reader_joins_continued_lines_in_code_blocks(tmp_path: Path) -> None:
    text = "intro `dflash-train check DIR`\n```bash\ndflash-train export \\\n  --checkpoint C\n```\n"
    assert list(shell_snippets(text)) == ["dflash-train export    --checkpoint C", "dflash-train check DIR"]


def test_the_flags_come_from_the_commands_own_parsers(monkeypatch: pytest.MonkeyPatch) -> None:
    assert {"--draft", "--num-prompts"} <= command_flags("eval", monkeypatch)
    assert "--draft" not in command_flags("export", monkeypatch)
    assert {"--variants", "--section"} <= command_flags("benchmarks.decode", monkeypatch)
    assert "--interleave" in command_flags("dflash_train.prompts.pack", monkeypatch)
