"""One module per `dflash-train` subcommand, each with a docstring, `add_arguments(parser)` and
`run(args) -> exit status`.

`dflash_train.cli` gathers them under one parser (with each one's help line); `run_command` runs one of them alone (``python -m
dflash_train.commands.eval ...``) with the same arguments and the same one-line errors. Both live here,
below the command modules and the CLI alike, so that no command module needs to import the CLI.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import NoReturn

from dflash_train.errors import run_with_one_line_errors

PROG = "dflash-train"


class UsageError(Exception):
    """A command line that argparse refuses; reported in one line by `parse_or_report`."""


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line saying what to do, not the whole usage text first (the usage
    of a command with twenty flags would bury the line that matters)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


def parse_or_report(parse: Callable[[], argparse.Namespace]) -> argparse.Namespace | None:
    """`parse()`, or None after printing the one line of a refused command line (the caller exits with 2)."""
    try:
        return parse()
    except UsageError as error:
        print(error, file=sys.stderr)
        return None


def add_command_parser(subparsers: argparse._SubParsersAction, name: str, help_line: str,
                       command: ModuleType) -> None:
    """Register `command` as `dflash-train <name>`."""
    parser = subparsers.add_parser(name, help=help_line, description=command.__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    command.add_arguments(parser)


def run_parsed(name: str, command: ModuleType, args: argparse.Namespace) -> int:
    """`command.run(args)`, a user error ending as one line `dflash-train <name>: error: ...` (status 2)."""
    return run_with_one_line_errors(f"{PROG} {name}", lambda: command.run(args))


def run_command(name: str, command: ModuleType, argv: Sequence[str]) -> int:
    """Parse `argv` as `dflash-train <name>` would, and run `command`."""
    parser = OneLineErrorParser(prog=f"{PROG} {name}", description=command.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    command.add_arguments(parser)
    args = parse_or_report(lambda: parser.parse_args(argv))
    return 2 if args is None else run_parsed(name, command, args)
