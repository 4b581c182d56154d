"""Check a drafter directory (ours or anyone's) against the export contract: required files and
config keys, tensor names and shapes, one dtype, mask and layer ids in range, and with --target
agreement with the target's hidden size, vocabulary, layer count and max positions. Prints one line
per problem and exits with status 1 if there is any.

    dflash-train check exports/SmolLM2-135M-DFlash-b16 --target smollm2-135m-instruct
"""

from __future__ import annotations

import argparse

from dflash_train.checkpoint import check_checkpoint
from dflash_train.commands.data_args import add_target_argument
from dflash_train.target import load_target_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="checkpoint directory")
    add_target_argument(parser, required=False, use="the target to check the drafter against")


def run(args: argparse.Namespace) -> int:
    target_config = load_target_config(args.target) if args.target else None
    problems = check_checkpoint(args.directory, target_config)
    for problem in problems:
        print(f"{args.directory}: {problem}")
    if problems:
        return 1
    print(f"{args.directory}: OK")
    return 0
