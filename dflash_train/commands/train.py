"""Train a DFlash drafter from a YAML recipe (`dflash-train train`, or `python -m dflash_train.train`).

    # one process (GPU or CPU)
    python -m dflash_train.train --config recipes/smollm2-135m-dflash-b16.yaml
    dflash-train train --config recipes/smollm2-135m-dflash-b16-cpu.yaml training.max_steps=20
    # several GPUs / DeepSpeed / FSDP: the same module under accelerate
    accelerate launch --config_file recipes/accelerate/ddp.yaml -m dflash_train.train \\
        --config recipes/qwen3-8b-dflash-b16.yaml

Overrides are dotted `section.key=value` pairs (YAML values), e.g. `training.learning_rate=3e-4`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from dflash_train.commands import OneLineErrorParser, parse_or_report
from dflash_train.errors import run_with_one_line_errors
from dflash_train.outputs import claim_training_dir
from dflash_train.training.config import load_config
from dflash_train.training.trainer import run_training


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="recipe YAML, e.g. recipes/smollm2-135m-dflash-b16.yaml")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    parser.add_argument("--overwrite", action="store_true", help="write into a training.output_dir that holds other "
                        "files (kept), or, with training.resume=none, remove the run there first")


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    claim_training_dir(config, args.overwrite)
    result = run_training(config)
    # Each process of a distributed run ends its process group itself, as torch asks of every trainer process:
    # left to the interpreter's exit, NCCL warns at the end of every run that resources may leak.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if result.finished:
        print(f"trained {result.steps} steps; final checkpoint: {result.final_checkpoint}")
    else:
        print(f"stopped at step {result.steps} of {result.total_steps}; checkpoint: {result.final_checkpoint} "
              f"(the same command resumes)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="python -m dflash_train.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parse_or_report(lambda: parser.parse_args(argv))
    if args is None:  # a bad command line, said in one line
        return 2
    return run_with_one_line_errors("dflash-train train", lambda: run(args))
