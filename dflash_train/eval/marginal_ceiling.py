"""The ceiling of an independent-slot drafter fitted to the target's distribution, at a temperature: prompt sets
decoded with the marginal oracle (`marginal_oracle.py`: each slot drafted from the target's own marginal over the
slots before it), τ and the acceptance of every slot per set and temperature, into one JSON report.

    python -m dflash_train.eval.marginal_ceiling --target smollm2-135m-instruct \\
        --prompts humaneval,mt-bench,math-synthetic --num-prompts 10 --max-new-tokens 128 \\
        --temperature 0.7,1 --samples 32 --seed 0 --output ceiling.json

Requests are `dflash-train eval`'s: its prompt sets under its names (or a .jsonl file), each conversation's turns
in order, a later turn seeing the answer to the earlier one (here the oracle's, which is distributed as the
target's own at T). Each request draws from a generator seeded by --seed, the set and the request, the same at
every temperature. At T = 0 the oracle drafts the greedy path and τ is the block size by construction, so the
temperatures are above 0. The report gives, per set, the eval's acceptance statistics (τ over requests with its
bootstrap interval, the histogram of a+1, per-slot and per-slot-given-reached rates) and two averages over the
cycles that reached each slot: the acceptance expected with the slot's own draft integrated out (the same rate
as the counted one, with less noise), and the acceptance a draft of the marginal's likeliest token would have had
on the same prefix (what a colder drafter could gain at that slot).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
import transformers
from rich.progress import Progress

from dflash_train.atomic import write_json_atomically
from dflash_train.data.prompt_ids import prompt_ids, stop_token_ids
from dflash_train.errors import run_with_one_line_errors
from dflash_train.eval.console import PassProgress, progress_bars
from dflash_train.eval.marginal_oracle import MarginalOracle, SlotTotals
from dflash_train.eval.metrics import acceptance_metrics
from dflash_train.prompts.eval_sets import PromptSet, load_prompt_set
from dflash_train.runtime.sampling import request_seed
from dflash_train.target import TargetModel, load_target

PROG = "python -m dflash_train.eval.marginal_ceiling"
DEFAULT_TARGET = "smollm2-135m-instruct"  # the demo's target: the SmolLM2 wheel's GGUF, converted once
REPORT_KIND = "dflash-marginal-ceiling"


class _UsageError(Exception):
    """A command line argparse refuses: `main` prints it as one line and returns 2."""


class _Parser(argparse.ArgumentParser):
    """A refused flag is one line saying what to do, as the `dflash-train` commands say it, not the usage first."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _temperatures(text: str) -> list[float]:
    """A comma list of temperatures above 0, each once."""
    values: list[float] = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes numbers > 0 (a comma list), not {part.strip()!r}") from None
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"takes temperatures > 0, not {part.strip()!r} (at 0 the oracle drafts "
                                             "the greedy path: τ is the block size by construction)")
        if value in values:
            raise argparse.ArgumentTypeError(f"lists temperature {value:g} twice")
        values.append(value)
    return values


def parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"alias, local model directory or .gguf file (default: {DEFAULT_TARGET})")
    parser.add_argument("--prompts", default="humaneval,mt-bench,math-synthetic",
                        help="comma list of `dflash-train eval` prompt sets (humaneval, mt-bench, alpaca-eval, ifeval, "
                             "math-synthetic) or .jsonl files")
    parser.add_argument("--num-prompts", type=_count, default=10, help="conversations per set, spread over it")
    parser.add_argument("--max-new-tokens", type=_count, default=128)
    parser.add_argument("--temperature", dest="temperatures", type=_temperatures, default=[0.7, 1.0],
                        help="comma list of temperatures > 0 (default: 0.7,1)")
    parser.add_argument("--samples", type=_count, default=32, help="M: target paths the marginals are averaged over")
    parser.add_argument("--block-size", type=_count, default=16, help="B: the block, slot 0 and B-1 drafts")
    parser.add_argument("--verification", choices=("token", "block"), default="token",
                        help="how the oracle's drafts are tested: each on its own in order (token, the eval's "
                             "default) or the block together (block verification: every slot drafted each cycle)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--output", default="marginal_ceiling.json", help="the JSON report")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def run(args: argparse.Namespace) -> int:
    if args.block_size < 2:
        raise ValueError("--block-size must be at least 2: slot 0 is the last committed token, the drafts follow it")
    output = Path(args.output)
    if output.is_dir():
        raise ValueError(f"--output {output} is a folder; give the report's .json path")
    output.parent.mkdir(parents=True, exist_ok=True)  # a path that cannot be written fails now, not after the run
    prompt_sets = [load_prompt_set(name.strip(), args.num_prompts) for name in args.prompts.split(",") if name.strip()]
    if not prompt_sets:
        raise ValueError("--prompts names no prompt set")
    device = _device(args.device)
    started = time.perf_counter()
    target = load_target(args.target, dtype=getattr(torch, args.dtype), device=device)
    stops = stop_token_ids(target.tokenizer, target.model.generation_config)
    oracle = MarginalOracle(target, args.samples, args.block_size, args.temperatures[0], torch.Generator(device),
                            verification=args.verification)
    results: dict[str, dict[str, Any]] = {}
    report: dict[str, Any] = {"kind": REPORT_KIND, "target": args.target, "settings": _settings(args),
              "environment": _environment(device), "temperatures": results, "complete": False}
    with progress_bars(enabled=not args.no_progress) as progress:
        for temperature in args.temperatures:
            oracle.temperature = temperature
            sets = results.setdefault(f"{temperature:g}", {})
            for prompt_set in prompt_sets:
                sets[prompt_set.name] = decode_set(oracle, target, prompt_set, args, stops, progress,
                                                   f"T={temperature:g}")
                # Written after every set: a run stopped early keeps the sets it finished.
                report["seconds"] = round(time.perf_counter() - started, 1)
                write_json_atomically(output, report)
    report["complete"] = True
    write_json_atomically(output, report)
    for temperature, sets in results.items():
        line = ", ".join(f"{name} τ {row['acceptance_length']:.2f}" for name, row in sets.items()
                         if row["acceptance_length"] is not None)
        print(f"T={temperature}: {line}")
    print(f"report: {output}")
    return 0


def decode_set(oracle: MarginalOracle, target: TargetModel, prompt_set: PromptSet, args: argparse.Namespace,
               stops: Sequence[int], progress: Progress | None, label: str) -> dict[str, Any]:
    """Every request of one set, turn by turn, and its statistics."""
    limit = int(getattr(target.config.get_text_config(), "max_position_embeddings", 1 << 20))
    set_key = zlib.crc32(prompt_set.name.encode())  # a request's draws do not depend on the other sets listed
    # a conversation's messages so far; None once a turn of it did not fit the context
    histories: list[list[dict[str, str]] | None] = [list(c.prefix) for c in prompt_set.conversations]
    requests = sum(len(c.turns) for c in prompt_set.conversations)
    bar = PassProgress(progress, f"{prompt_set.name} {label}", requests)
    slots, done, too_long, tokens, started = SlotTotals.zeros(args.block_size - 1), [], 0, 0, time.perf_counter()
    for turn in range(max(len(c.turns) for c in prompt_set.conversations)):
        for index, conversation in enumerate(prompt_set.conversations):
            history = histories[index]
            if turn >= len(conversation.turns) or history is None:
                continue
            messages = history + [{"role": "user", "content": conversation.turns[turn]}]
            ids = prompt_ids(target.tokenizer, messages, False)
            if len(ids) + args.max_new_tokens + args.block_size > limit:
                too_long, histories[index] = too_long + 1, None  # its later turns would be longer still
                continue
            oracle.generator.manual_seed(request_seed(args.seed, set_key, index, turn))
            out = oracle.decode(ids, args.max_new_tokens, stops, slots)
            answer = target.tokenizer.decode(out.tokens, skip_special_tokens=True)
            histories[index] = messages + [{"role": "assistant", "content": answer}]
            done.append((index, turn, out.acceptance_lengths))
            tokens += len(out.tokens)
            bar.finished(len(done), out)
    if not done:
        raise ValueError(f"no prompt of {prompt_set.name} fits the target's context with --max-new-tokens "
                         f"{args.max_new_tokens}; lower it")
    seconds = time.perf_counter() - started
    metrics = acceptance_metrics([lengths for _, _, lengths in done], args.block_size)
    return {"source": prompt_set.source, "conversations": len({index for index, _, _ in done}),
            "requests": len(done), "skipped_too_long": too_long, "new_tokens": tokens,
            "seconds": round(seconds, 1), "tokens_per_s": tokens / seconds if seconds > 0 else None, **metrics,
            "slot_reached": slots.reached, **{f"per_slot_{key}": value for key, value in slots.rates().items()},
            "acceptance_length_per_request": [[index, turn, sum(lengths) / len(lengths) if lengths else None]
                                              for index, turn, lengths in done]}


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device; use cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is visible; use --device cpu")
    return device


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"prompts": args.prompts, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
            "temperatures": args.temperatures, "samples": args.samples, "block_size": args.block_size,
            "verification": args.verification,
            "seed": args.seed, "dtype": args.dtype, "device": args.device}


def _environment(device: torch.device) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    return {"device": name, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "CPU: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU: " + (platform.processor() or platform.machine())


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    except _UsageError as error:
        print(error, file=sys.stderr)
        return 2
    return run_with_one_line_errors(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
