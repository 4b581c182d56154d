"""Regenerate the responses of chat prompts with the target (greedy or sampled), resumably.

Built-in generation through the runtime (static KV cache, CUDA graphs on GPU, no per-token host sync;
--decode-rows rows at once, each refilled with the next prompt when it finishes):

    dflash-train regenerate --target smollm2-135m-instruct --data data/prompts/demo_prompts.jsonl \\
        --max-new-tokens 128 --batch-size 8 --out runs/regen-smollm2
    dflash-train regenerate --target smollm2-135m-instruct --data sharegpt --max-samples 10000 \\
        --max-new-tokens 1024 --batch-size 128 --out runs/regen-sharegpt
    dflash-train regenerate --target smollm2-135m-instruct --data reasoning-gym-math:steps --max-samples 2000 \\
        --max-new-tokens 512 --batch-size 128 --device cuda --out runs/regen-math

Any OpenAI-compatible server (vLLM, SGLang, llama.cpp) for targets too big for one process; --target
still names the model whose tokenizer and template plan the prompts:

    dflash-train regenerate --target Qwen/Qwen3-8B --thinking off --data sharegpt \\
        --server-url http://127.0.0.1:8000/v1 --server-model Qwen/Qwen3-8B --concurrency 64 --out runs/regen-qwen3

Multi-turn conversations (ShareGPT, say): `--turns all` answers every user turn, each after the target's
own earlier answers (`--turns 1`, the default, answers the first).

Several processes split the work (`torchrun --nproc-per-node 8 -m dflash_train.cli regenerate ...` or
--rank/--world-size). A killed run resumes with the same command; the output directory is an OpenAI-messages
corpus for `dflash-train prepare --data DIR`. Stopped by SIGTERM (`timeout`) or Ctrl-C, the command prints what
it finished and how fast (from regen_stats.json, rewritten after every shard) and exits 143 or 130.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from dflash_train.commands.data_args import (
    TORCH_DTYPES,
    add_corpus_arguments,
    add_runtime_arguments,
    add_target_argument,
    add_thinking_argument,
    corpus_specs,
    generation_config,
    non_negative_int,
    positive_int,
    resolve_device,
    temperature,
    thinking_value,
    top_p,
    tqdm_progress,
)
from dflash_train.data.chat import ChatTokenizer
from dflash_train.data.target_tokenizer import load_target_tokenizer
from dflash_train.errors import found_in_chain
from dflash_train.json_files import json_object_or_none
from dflash_train.outputs import (
    REGENERATED,
    claim,
    foreign_entries,
    holds_output,
    refuse_inputs_inside,
    remove_owned,
)
from dflash_train.regeneration.backends import LocalBackend, OpenAIBackend
from dflash_train.regeneration.regenerate import (
    RegenerateConfig,
    latest_stats,
    manifest_settings,
    plan_prompts,
    plan_units,
    regenerate,
    stopped_line,
)
from dflash_train.regeneration.turns import count_turns, turn_directory
from dflash_train.runtime.config import EngineConfig
from dflash_train.shards import REGEN_MANIFEST, rank_and_world
from dflash_train.target import TargetModel, load_target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_argument(parser)
    parser.add_argument("--out", required=True, type=Path, help="output directory (resumed if it exists)")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over in --out: remove an earlier run's files if made with other settings (a run "
                             "with the same settings is resumed, so every rank may pass it); other files are kept")
    add_corpus_arguments(parser)
    add_thinking_argument(parser)
    parser.add_argument("--max-new-tokens", type=positive_int, default=1024)
    parser.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples-per-prompt", type=positive_int, default=1, metavar="K",
                        help="answers sampled per prompt (needs --temperature > 0), each a row of its own")
    parser.add_argument("--top-p", type=top_p, default=1.0, help="nucleus sampling at --temperature > 0")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="rows per output shard")
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=2048, help="longer prompts are skipped")
    parser.add_argument("--keep-duplicates", action="store_true", help="do not drop repeated prompts")
    parser.add_argument("--stop-loops", action="store_true",
                        help="built-in back end: end an answer once its last tokens repeat one span of up to 64 tokens "
                             "verbatim (3 copies, 64 tokens at least; finish_reason loop, unfinished like length), so "
                             "its row takes the next prompt instead of decoding the loop to --max-new-tokens")
    parser.add_argument("--turns", type=_turns, default=1,
                        help="user turns answered per conversation, each after the target's own earlier answers: "
                             "N or all (default 1: the first turn)")
    add_runtime_arguments(parser, "rows decoded at once, each refilled with the next prompt when it finishes "
                                  "(default: 256 on a GPU, --batch-size on a CPU); greedy bf16 answers may differ at another "
                                  "row count, where a near-tie breaks otherwise",
                          prefix="built-in back end: ")
    server = parser.add_argument_group("OpenAI-compatible server back end")
    server.add_argument("--server-url", default=None, help="e.g. http://127.0.0.1:8000/v1")
    server.add_argument("--server-model", default=None, help="model name the server expects (default: --target)")
    server.add_argument("--concurrency", type=positive_int, default=16)
    server.add_argument("--api-key", default=None)
    parser.add_argument("--rank", type=non_negative_int, default=None, help="default: $RANK or 0")
    parser.add_argument("--world-size", type=positive_int, default=None, help="default: $WORLD_SIZE or 1")


def _turns(text: str) -> int | None:
    if text == "all":
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--turns takes a number >= 1 or all, not {text!r}")
    return int(text)


def _recorded(args: argparse.Namespace) -> dict[str, Any]:
    """The back end's settings recorded in the manifest (a resume must match them); top_p only when it
    filters, so that runs started before it existed still resume."""
    nucleus = {"top_p": args.top_p} if args.top_p < 1.0 else {}
    loops = {"stop_loops": True} if args.stop_loops else {}
    return {"backend": "openai", **nucleus} if args.server_url else {"backend": "local", "dtype": args.dtype,
                                                                     **nucleus, **loops}


def _backend(args: argparse.Namespace, tokenizer: object) -> LocalBackend | OpenAIBackend:
    if args.server_url:
        return OpenAIBackend(args.server_url, args.server_model or args.target, args.max_new_tokens,
                             args.temperature, thinking_value(args), args.concurrency, args.api_key,
                             top_p=args.top_p)
    target = load_target(args.target, dtype=TORCH_DTYPES[args.dtype], device=resolve_device(args.device))
    return LocalBackend(target, _runtime_config(args, target), args.batch_size)


def _runtime_config(args: argparse.Namespace, target: TargetModel) -> EngineConfig:
    """The runtime's settings: no drafter, caches long enough for the longest prompt kept and its answer."""
    rows = args.decode_rows or (256 if target.device.type == "cuda" else args.batch_size)
    return generation_config(args, target, rows, args.max_prompt_tokens + args.max_new_tokens + 1,
                             stop_loops=args.stop_loops)


def _claim_out(out: Path, chat: ChatTokenizer, config: RegenerateConfig, overwrite: bool) -> None:
    """Before the target loads: resume an earlier run in --out (`regenerate` refuses other settings), refuse a
    folder holding other files unless --overwrite, and with --overwrite remove a run made with other settings."""
    refuse_inputs_inside(out, [spec.source for spec in config.sources] + [config.settings["target"]])
    if overwrite and holds_output(out, REGENERATED) and _made_otherwise(out, chat, config):
        remove_owned(out, REGENERATED)
    claim(out, REGENERATED, inputs=(), overwrite=overwrite,
          reusable=holds_output(out, REGENERATED) or not foreign_entries(out, REGENERATED))


def _made_otherwise(out: Path, chat: ChatTokenizer, config: RegenerateConfig) -> bool:
    """Whether the run in ``out`` differs from this one in its first turn's manifest (the plan is redone here:
    it depends on the prompts alone)."""
    rows, _ = plan_prompts(chat, config)
    if not rows:
        return False  # `regenerate` says why
    rounds = count_turns(rows, config.turns)
    expected = manifest_settings(chat, config, len(rows), len(plan_units(rows, config.batch_size)))
    if config.turns != 1:
        expected.update(turns=config.turns, turn=1, rounds=rounds)
    found = json_object_or_none(turn_directory(out, 1, rounds) / REGEN_MANIFEST)
    return found is None or any(found.get(key) != value for key, value in expected.items())


class Stopped(Exception):
    """A termination signal, raised in the main thread so that the run reports what it finished."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    raise Stopped(signum)


def reporting_stops(work: Callable[[], int], out: Path, rank: int, world: int, started: float) -> int:
    """``work()``, or on SIGTERM/Ctrl-C the stopped line and 128 + the signal, the code of a process killed
    by it (so scripts still see a stop). The handler is this command's only, restored after. A stop that
    arrived while a compiler ran (Triton, torch.compile) comes wrapped in the compiler's own error; it is
    a stop all the same, and any other error is raised unchanged."""
    on_main = threading.current_thread() is threading.main_thread()  # signal.signal works there only
    previous = signal.signal(signal.SIGTERM, _raise_stopped) if on_main else None
    try:
        return work()
    except (KeyboardInterrupt, Exception) as error:
        stop = found_in_chain(error, (KeyboardInterrupt, Stopped))
        if stop is None:
            raise
        signum = stop.signum if isinstance(stop, Stopped) else int(signal.SIGINT)
        print(stopped_line(latest_stats(out, rank, world, started)), flush=True)
        return 128 + signum
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def run(args: argparse.Namespace) -> int:
    started = time.time()  # model load, compile and planning count in the overall rate
    if args.stop_loops and args.server_url:  # before any model or tokenizer loads
        raise ValueError("--stop-loops works in the built-in back end only: leave it out with --server-url")
    rank, world = rank_and_world(args.rank, args.world_size)
    tokenizer = load_target_tokenizer(args.target)
    chat = ChatTokenizer(tokenizer, thinking_value(args), args.target)
    config = RegenerateConfig(
        corpus_specs(args), args.max_new_tokens, args.temperature, args.seed, thinking_value(args),
        args.batch_size, args.max_prompt_tokens, not args.keep_duplicates,
        settings={"target": args.target, **_recorded(args)}, turns=args.turns,
        samples_per_prompt=args.samples_per_prompt, started=started,
    )
    _claim_out(args.out, chat, config, args.overwrite)
    return reporting_stops(lambda: _run(args, tokenizer, chat, config, rank, world), args.out, rank, world, started)


class _BuiltOnFirstUse:
    """The back end, built when regeneration first uses it: a corpus with no usable prompt is refused, and a
    finished run resumed, without loading the target's weights first."""

    def __init__(self, build: Callable[[], LocalBackend | OpenAIBackend]) -> None:
        self._build, self._backend = build, None

    def __getattr__(self, name: str) -> Any:
        if self._backend is None:
            self._backend = self._build()
        return getattr(self._backend, name)


def _run(args: argparse.Namespace, tokenizer: object, chat: ChatTokenizer, config: RegenerateConfig, rank: int,
         world: int) -> int:
    backend = _BuiltOnFirstUse(lambda: _backend(args, tokenizer))
    manifest = regenerate(backend, chat, config, args.out, rank, world, tqdm_progress("regenerate", "tok/s"))
    where = f"turn {manifest['turn']} of {manifest['rounds']}: " if manifest.get("rounds", 1) > 1 else ""
    print(f"regenerate: {where}{manifest['units_finished']} of {manifest['num_units']} shards in {args.out}"
          + ("" if manifest["complete"] else " (other ranks, or a rerun, finish the rest)"))
    return 0
