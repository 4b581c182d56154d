"""Tokenise chat data with the target's chat template and mark the assistant tokens to train on.

    dflash-train prepare --target smollm2-135m-instruct --data runs/regen-smollm2 --out runs/prepared-smollm2
    dflash-train prepare --target smollm2-135m-instruct --data sharegpt --max-samples 2000 --out runs/prepared-sharegpt
    dflash-train prepare --target Qwen/Qwen3-8B --thinking off --data my_chats.jsonl --columns messages=chat \\
        --max-length 3072 --out runs/prepared-qwen3

The output is a `datasets` directory (`input_ids`, `loss_mask`, metadata columns) with `dflash_data.json`
beside the data; `dflash_train.data.load_prepared(path)` reads it. Rows with fewer than 2 x --block-size
supervised tokens are dropped; the summary lists rows read, kept and dropped by reason, with a warning line
for a reason that drops more than 5 % of them. Rows whose system or user turns share a word 13-gram with an
eval set (HumanEval, MT-Bench, the generated math set, and AlpacaEval and IFEval when installed) are dropped
as overlaps_eval_set (`--no-decontaminate` keeps them). `--show N` prints N rows with the supervised text
between ⟦ ⟧ and writes nothing: look at a new target's rows before training on them. Rows are tokenised in
--workers processes (default: one per core, at most 16); the dataset is the same with any number of them.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dflash_train.commands.data_args import (
    add_corpus_arguments,
    add_target_argument,
    add_thinking_argument,
    corpus_specs,
    positive_int,
    thinking_value,
)
from dflash_train.data.prepare import PARALLEL_MIN_ROWS, PrepareConfig, default_workers, prepare, show
from dflash_train.data.target_tokenizer import load_target_tokenizer
from dflash_train.prompts.decontaminate import project_eval_index


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_argument(parser, use="its tokenizer only")
    parser.add_argument("--out", type=Path,  # required, except with --show
                        help="output directory: new, empty, or an earlier prepare of the same inputs (replaced)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the files of another prepared dataset in --out (other files are kept)")
    add_corpus_arguments(parser)
    add_thinking_argument(parser)
    parser.add_argument("--max-length", type=positive_int, default=3072, help="tokens per row; longer rows are cut")
    parser.add_argument("--block-size", type=positive_int, default=16, help="drafter block size B (rows need 2B supervised)")
    parser.add_argument("--train-turns", choices=("all", "last"), default="all",
                        help="assistant turns in the loss: all of them or only the last")
    parser.add_argument("--no-decontaminate", action="store_true",
                        help="keep rows whose prompt turns share a word 13-gram with an eval set (dropped by default "
                             "as overlaps_eval_set; the eval sets used are recorded in the dataset's metadata)")
    parser.add_argument("--trim-loops", action="store_true",
                        help="cut answers the token cap stopped inside a verbatim loop (a phrase repeated to the end) "
                             "to two copies of it: the rest costs training time and teaches nothing new")
    parser.add_argument("--keep-duplicates", action="store_true",
                        help="keep conversations identical to an earlier one (dropped by default as "
                             "duplicate_conversation: several sampled answers to one prompt can be the same)")
    parser.add_argument("--exclude-source", action="append", default=[], metavar="NAME",
                        help="leave out records labelled with this source (repeatable), e.g. one source of a "
                             "regenerated mix, without regenerating the others")
    parser.add_argument("--cap-source", action="append", default=[], type=source_cap, metavar="NAME=N",
                        help="keep at most the first N records labelled with this source (repeatable), e.g. a "
                             "regenerated mix's word problems cut back to an earlier share without regenerating")
    parser.add_argument("--workers", type=positive_int, default=default_workers(), metavar="N",
                        help="processes tokenising the rows (default: one per core, at most 16; 1 = this process "
                             f"alone; inputs under {PARALLEL_MIN_ROWS:,} rows always are); the output is the same")
    parser.add_argument("--show", type=positive_int, metavar="N",
                        help="print N rows with their supervised text marked ⟦ ⟧ and write nothing (check a new "
                             "target's chat template before training)")


def source_cap(text: str) -> tuple[str, int]:
    """"NAME=N" -> (NAME, N): a source label (which may hold ":" and "=") and a count of at least 1."""
    name, equals, count = text.rpartition("=")
    if not equals or not name or not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a source and a count, e.g. word-problems:steps=6000")
    return name, int(count)


def run(args: argparse.Namespace) -> int:
    if args.show is None and args.out is None:
        raise ValueError("prepare needs --out DIR (or --show N to look at N rows without writing anything)")
    if args.show is not None and args.show < 1:
        raise ValueError(f"--show {args.show}: give the number of rows to print, 1 or more")
    start = time.perf_counter()
    tokenizer = load_target_tokenizer(args.target)
    config = PrepareConfig(corpus_specs(args), args.max_length, args.block_size, thinking_value(args),
                           args.train_turns, args.target, decontaminate=not args.no_decontaminate,
                           workers=args.workers, trim_loops=args.trim_loops,
                           exclude_sources=tuple(args.exclude_source), source_caps=tuple(args.cap_source),
                           dedupe=not args.keep_duplicates)
    if args.show is not None:
        show(tokenizer, config, args.show).print()
        return 0
    report = prepare(tokenizer, config, args.out, args.overwrite)
    report.totals["seconds"] = round(time.perf_counter() - start)
    report.print()
    if config.decontaminate:
        print(project_eval_index().summary())
    return 0
