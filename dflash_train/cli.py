"""The `dflash-train` console script: one entry point, one subcommand per module in `commands/`.

    dflash-train inspect --target smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dflash_train.commands import check as check_command
from dflash_train.commands import eval as eval_command
from dflash_train.commands import export as export_command
from dflash_train.commands import extract as extract_command
from dflash_train.commands import inspect_target
from dflash_train.commands import prepare as prepare_command
from dflash_train.commands import push as push_command
from dflash_train.commands import regenerate as regenerate_command
from dflash_train.commands import train as train_command
from dflash_train.disk import disk_full_message

COMMANDS = {"inspect": inspect_target, "train": train_command,
            "export": export_command, "check": check_command, "push": push_command,
            "prepare": prepare_command,
            "regenerate": regenerate_command,
            "extract": extract_command,
            "eval": eval_command}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-train", description="Train and use DFlash drafters.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.__doc__,
                                            formatter_class=argparse.RawDescriptionHelpFormatter))
    return parser


def close_progress_bars() -> None:
    """Finish any bar a failed command left open, so that its error starts on a line of its own."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", [])):
        bar.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except ValueError as error:  # user errors: one line that says what to do, no traceback
        close_progress_bars()
        print(f"dflash-train {args.command}: error: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        message = disk_full_message(error)
        if message is None:
            raise
        close_progress_bars()
        print(f"dflash-train {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
