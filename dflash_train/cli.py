"""The `dflash-train` console script: one entry point, one subcommand per module in `commands/`.

    dflash-train inspect --target smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dflash_train.commands import (
    OneLineErrorParser,
    add_command_parser,
    inspect_target,
    parse_or_report,
    run_parsed,
)
from dflash_train.commands import check as check_command
from dflash_train.commands import eval as eval_command
from dflash_train.commands import export as export_command
from dflash_train.commands import extract as extract_command
from dflash_train.commands import prepare as prepare_command
from dflash_train.commands import push as push_command
from dflash_train.commands import regenerate as regenerate_command
from dflash_train.commands import train as train_command

COMMANDS = {"inspect": inspect_target, "train": train_command,
            "export": export_command, "check": check_command, "push": push_command,
            "prepare": prepare_command,
            "regenerate": regenerate_command,
            "extract": extract_command,
            "eval": eval_command}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="dflash-train", description="Train and use DFlash drafters.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        add_command_parser(sub, name, module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_or_report(lambda: build_parser().parse_args(argv))
    if args is None:
        return 2
    return run_parsed(args.command, COMMANDS[args.command], args)


if __name__ == "__main__":
    sys.exit(main())
