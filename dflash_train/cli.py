"""The `dflash-train` console script: one entry point, one subcommand per module in `commands/`.

    dflash-train inspect --target smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

from dflash_train.commands import OneLineErrorParser, add_command_parser, parse_or_report, run_parsed

# Subcommand -> (its module in `commands/`, its line in `dflash-train --help`). The command modules import
# torch, transformers and the rest of the package at their top, seconds in all; this is the one place that
# defers them: only the module of the command that runs is imported, so `dflash-train --help` and a
# mistyped command answer at once.
COMMANDS: dict[str, tuple[str, str]] = {
    "inspect": ("inspect_target", "show a target's shape, default layer ids and mask token"),
    "train": ("train", "train a drafter from a YAML recipe"),
    "export": ("export", "export a drafter checkpoint for SGLang, vLLM and Transformers"),
    "check": ("check", "validate a drafter checkpoint directory against the export contract"),
    "push": ("push", "upload an exported drafter to the Hugging Face Hub"),
    "prepare": ("prepare", "tokenise chat data with the target's template and loss masks"),
    "regenerate": ("regenerate", "regenerate responses with the target (built-in or OpenAI-compatible server)"),
    "self-prompt": ("self_prompt", "write chat prompts with the target itself (sampled user turns, deduplicated)"),
    "extract": ("extract", "store the target's features of a prepared dataset (offline training), or --verify "
                           "a store"),
    "eval": ("eval", "measure acceptance length, losslessness and speedup of a drafter on prompt sets"),
}


def command_module(name: str) -> ModuleType:
    return importlib.import_module(f"dflash_train.commands.{COMMANDS[name][0]}")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `dflash-train` parser; of the subcommands, only `command` gets its arguments (and its module
    imported): the others are listed by name and help line."""
    parser = OneLineErrorParser(prog="dflash-train", description="Train and use DFlash drafters.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_line) in COMMANDS.items():
        if name == command:
            add_command_parser(sub, name, help_line, command_module(name))
        else:
            sub.add_parser(name, help=help_line)
    return parser


def _named_command(argv: Sequence[str]) -> str | None:
    """The subcommand `argv` names: its first word that is not an option (no top-level option takes a value)."""
    word = next((arg for arg in argv if not arg.startswith("-")), None)
    return word if word in COMMANDS else None


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_or_report(lambda: build_parser(_named_command(argv)).parse_args(argv))
    if args is None:
        return 2
    return run_parsed(args.command, command_module(args.command), args)


if __name__ == "__main__":
    sys.exit(main())
