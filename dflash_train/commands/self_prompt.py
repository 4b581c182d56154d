"""Write chat prompts with the target itself (self-prompting, as in Magpie): sampled continuations of the opening
of a user turn in its chat template, kept when the target ended the turn, distinct, and clear of the eval sets.

    dflash-train self-prompt --target smollm2-135m-instruct --num-prompts 20000 --out runs/self_prompts.jsonl
    dflash-train regenerate --target smollm2-135m-instruct --data runs/self_prompts.jsonl --out runs/regen-self

The file is an OpenAI-messages corpus (source label "self-prompts") that `regenerate`, `prepare` and
`python -m dflash_train.prompts.pack --source runs/self_prompts.jsonl=N` read. Generation runs through the runtime
of `regenerate` (static caches, CUDA graphs, --decode-rows rows refilled as turns end); the same settings write
the same file. It ends early, with what it kept, when the target keeps writing prompts it wrote before.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tqdm import tqdm

from dflash_train.commands.data_args import (
    TORCH_DTYPES,
    add_runtime_arguments,
    add_target_argument,
    add_thinking_argument,
    generation_config,
    non_negative_int,
    positive_int,
    resolve_device,
    sampling_temperature,
    thinking_value,
    top_p,
)
from dflash_train.data.chat import ChatTokenizer
from dflash_train.outputs import check_output_file
from dflash_train.prompts.decontaminate import project_eval_index
from dflash_train.quality import DataReport
from dflash_train.regeneration.generation import Generator
from dflash_train.regeneration.self_prompts import (
    Settings,
    is_self_prompt_file,
    self_prompts,
    source_label,
    user_turn_prefix,
    write_rows,
)
from dflash_train.runtime.config import EngineConfig
from dflash_train.shards import rank_and_world
from dflash_train.target import TargetModel, load_target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_argument(parser)
    parser.add_argument("--num-prompts", type=positive_int, required=True, help="distinct prompts to keep")
    parser.add_argument("--out", required=True, type=Path, help="the JSONL to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier self-prompt file at --out")
    add_thinking_argument(parser)
    parser.add_argument("--temperature", type=sampling_temperature, default=1.0, help="sampling temperature (> 0)")
    parser.add_argument("--top-p", type=top_p, default=1.0, help="nucleus sampling (1: the whole distribution)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=256,
                        help="a longer turn is dropped as unfinished")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--opening", default="",
                        help="the start of every user turn, which the target continues: prompts of one kind in its "
                             "own words, e.g. 'Here is a math word problem for you to solve:' (default: none)")
    parser.add_argument("--request", default="",
                        help="a sentence appended to every kept prompt after a blank line, saying what the answer "
                             "should look like, e.g. 'Solve it step by step, then give the final answer in "
                             "\\boxed{}.' (default: none)")
    parser.add_argument("--label", default=None, metavar="NAME",
                        help="label the rows self-prompts:NAME (default: self-prompts), a data source of their own")
    parser.add_argument("--no-decontaminate", action="store_true",
                        help="keep prompts that share a word 13-gram with an eval set")
    parser.add_argument("--rank", type=non_negative_int, default=None,
                        help="this process's rank of --world-size, one a GPU: it keeps its share of --num-prompts in "
                             "a file of its own, --out's name with .rankR-ofW before the suffix (default: $RANK or 0)")
    parser.add_argument("--world-size", type=positive_int, default=None, help="default: $WORLD_SIZE or 1")
    add_runtime_arguments(parser, "rows decoded at once (default: 512 on a GPU, 16 on a CPU)")


def rank_file(out: Path, rank: int, world: int) -> Path:
    """The file rank `rank` of `world` writes: `out` itself for a single process."""
    return out if world == 1 else out.with_name(f"{out.stem}.rank{rank}-of{world}{out.suffix}")


def rank_share(count: int, rank: int, world: int) -> int:
    """Rank `rank`'s share of `count` prompts: equal shares, the first `count % world` ranks one more."""
    return count // world + (rank < count % world)


def _check_out(args: argparse.Namespace) -> None:
    source_label(args.label)  # a bad label is refused before the target loads
    if args.temperature <= 0:
        raise ValueError(f"--temperature {args.temperature}: self-prompting samples; give a temperature > 0 "
                         "(greedy decoding writes one prompt)")
    if args.out.is_dir():
        raise ValueError(f"--out {args.out} is a directory; give a .jsonl file path")
    check_output_file(args.out)  # written last: a bad path would fail after the whole generation
    if args.out.exists() and not args.overwrite:
        raise ValueError(f"--out {args.out} exists; pass --overwrite to replace it, or choose another path")
    if args.out.exists() and not is_self_prompt_file(args.out):
        raise ValueError(f"--out {args.out} holds other data than self-prompts; --overwrite replaces only an "
                         "earlier self-prompt file: choose another path")


def _engine_config(args: argparse.Namespace, target: TargetModel, prefix_tokens: int) -> EngineConfig:
    rows = args.decode_rows or (512 if target.device.type == "cuda" else 16)
    return generation_config(args, target, rows, prefix_tokens + args.max_new_tokens + 1)


def run(args: argparse.Namespace) -> int:
    rank, world = rank_and_world(args.rank, args.world_size)
    if rank_share(args.num_prompts, rank, world) == 0:
        raise ValueError(f"--num-prompts {args.num_prompts} leaves rank {rank} of {world} no prompt to write; ask for "
                         f"at least {world} or run on fewer processes")
    args.out, args.num_prompts = rank_file(args.out, rank, world), rank_share(args.num_prompts, rank, world)
    _check_out(args)
    started = time.time()
    target = load_target(args.target, dtype=TORCH_DTYPES[args.dtype], device=resolve_device(args.device))
    tokenizer = target.tokenizer
    chat = ChatTokenizer(tokenizer, thinking_value(args), args.target)
    settings = Settings(args.num_prompts, args.seed, opening=args.opening, request=args.request.strip(),
                        source=source_label(args.label), rank=rank, world=world)
    prefix_ids = chat.encode_texts([user_turn_prefix(chat) + args.opening])[0]
    config = _engine_config(args, target, len(prefix_ids))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(config.stop_token_ids, default=0)
    evals = None if args.no_decontaminate else project_eval_index()
    report = DataReport("self-prompt")
    with tqdm(total=args.num_prompts, desc="self-prompt", unit="prompt") as bar:
        def progress(kept: int, total: int) -> None:
            bar.update(kept - bar.n)
        rows = self_prompts(Generator(target, config, pad), lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                            prefix_ids, frozenset(tokenizer.all_special_ids), settings, evals, report, progress)
    write_rows(rows, args.out)
    left_out = ", ".join(f"{reason} {n:,}" for reason, n in sorted(report.dropped.items()))
    print(f"self-prompt: {len(rows):,} prompts kept of {report.read:,} drawn in {time.time() - started:.0f} s "
          f"(left out: {left_out or 'none'}) -> {args.out}")
    if len(rows) < args.num_prompts:
        print(f"self-prompt: warning: {len(rows):,} of the {args.num_prompts:,} asked for: the last rows drawn added "
              "almost no new prompt (what was left out, and why, is above); repeats call for a higher "
              "--temperature, unfinished turns for a higher --max-new-tokens")
    return 0
