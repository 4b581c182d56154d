"""Command-line pieces shared by the commands: argument types, the ``--target`` every command names the same
way, and the corpus, thinking and runtime arguments of ``prepare``, ``regenerate``, ``self-prompt`` and
``extract``."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch
from tqdm import tqdm

from dflash_train.prompts.corpora import BUILTIN_SOURCES, CorpusSpec
from dflash_train.prompts.records import FORMATS
from dflash_train.runtime.config import (
    COMPILE_SCOPE_HELP,
    COMPILE_SCOPES,
    KERNELS,
    EngineConfig,
    stop_token_ids,
)
from dflash_train.target import TargetModel

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _bounded_int(least: int) -> Callable[[str], int]:
    """An argparse `type` taking integers >= `least`: a 0 batch size or count is refused while the arguments are
    read, in one line, instead of failing deep inside the run (range() with a zero step, an empty loop)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {least}, not {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, not {value}")
        return value

    return parse


positive_int = _bounded_int(1)
non_negative_int = _bounded_int(0)


def positive_float(text: str) -> float:
    """An argparse `type` taking numbers > 0 (sizes in GB, say)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, not {text!r}") from None
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
    return value


def add_target_argument(parser: argparse.ArgumentParser, required: bool = True, use: str = "") -> None:
    """``--target``: an alias, Hub id, local model directory or .gguf file (``use``: what this command does
    with it, said in its help)."""
    parser.add_argument("--target", required=required, default=None,
                        help="alias, Hub id, local model directory or .gguf file" + (f" ({use})" if use else ""))


def add_corpus_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("input data")
    group.add_argument("--data", action="append", required=True, metavar="SOURCE",
                       help=f"built-in ({', '.join(BUILTIN_SOURCES)}), .jsonl/.json/.parquet/.arrow file, saved "
                            "dataset or regenerate output directory, or Hub dataset id; repeat to mix")
    group.add_argument("--split", default="train", help="split of Hub datasets")
    group.add_argument("--format", default="auto", choices=("auto", *FORMATS), help="record format")
    group.add_argument("--columns", default="", metavar="OURS=THEIRS,...",
                       help="column mapping, e.g. messages=chat or prompt=question")
    group.add_argument("--max-samples", type=positive_int, default=None, help="rows per source (after shuffling)")
    group.add_argument("--shuffle-seed", type=int, default=None, help="shuffle each source with this seed")
    group.add_argument("--allow-unfinished", action="store_true",
                       help="read only the finished shards of a `regenerate` output that is still incomplete")


def corpus_specs(args: argparse.Namespace) -> list[CorpusSpec]:
    mapping = {}
    for item in filter(None, args.columns.split(",")):
        if "=" not in item:
            raise ValueError(f"--columns item {item!r} is not OURS=THEIRS")
        ours, theirs = item.split("=", 1)
        mapping[ours.strip()] = theirs.strip()
    return [CorpusSpec(source, args.split, args.format, mapping, args.max_samples, args.shuffle_seed,
                       getattr(args, "allow_unfinished", False)) for source in args.data]


def add_thinking_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--thinking", choices=("on", "off"), default=None,
                        help="enable_thinking for templates that have it (Qwen3); default: the template's own")


def thinking_value(args: argparse.Namespace) -> bool | None:
    return None if args.thinking is None else args.thinking == "on"


def parse_device(requested: str) -> torch.device:
    """A device name as a torch device, refused in one line when torch does not know it or it is a CUDA device
    this machine does not have (torch would fail later, in a traceback from deep inside a model load)."""
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise ValueError(f"{requested!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{requested} requested but no CUDA device is visible; use --device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"{requested}: this machine has {count} CUDA device(s); use cuda:0 to cuda:{count - 1}")
    return device


def device_arg(text: str) -> str:
    """An argparse `type` for --device: a name that `parse_device` accepts, refused while the arguments are read,
    before a model loads or an output folder is made."""
    try:
        parse_device(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def resolve_device(requested: str | None) -> str:
    """``--device``, else ``cuda:$LOCAL_RANK`` (one GPU per process under torchrun/accelerate), else ``cpu``;
    a plain ``cuda`` means ``cuda:$LOCAL_RANK`` too. A CUDA device also becomes the current one, which CUDA
    streams and graphs use."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if requested is None:
        if not torch.cuda.is_available():
            return "cpu"
        requested = "cuda"
    device = parse_device(requested)
    if device.type == "cuda":
        if device.index is None:  # plain "cuda": this process's GPU (set_device needs an index)
            count = torch.cuda.device_count()
            if local_rank >= count:  # one process a GPU, started for more GPUs than there are
                raise ValueError(f"LOCAL_RANK {local_rank} asks for cuda:{local_rank}, but this machine has {count} "
                                 f"CUDA device(s): run at most {count} processes (the speedrun's GPUS), or pass "
                                 "--device")
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return str(device)


def tqdm_progress(description: str, unit: str) -> Callable[..., None]:
    """A progress callback ``(done, total, ..., rate)`` drawing one tqdm bar with the last rate."""
    bar: list[tqdm] = []

    def update(done: int, total: int, *rest: float) -> None:
        if not bar or done == 0:  # a new pass (the next turn of a regeneration, say): a new bar
            if bar:
                bar.pop().close()
            bar.append(tqdm(total=total, desc=description, unit="shard"))
        bar[0].update(done - bar[0].n)
        if rest and done:
            bar[0].set_postfix_str(f"{rest[-1]:,.0f} {unit}")
        if done == total:
            bar[0].close()

    return update


def temperature(text: str) -> float:
    """A sampling temperature, 0 (greedy) or more, for argparse: finite (nan or inf would sample from a broken
    distribution, not fail)."""
    value = _number(text)
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"takes a number >= 0 (0: greedy), not {text!r}")
    return value


def temperature_list(text: str) -> list[float]:
    """One sampling temperature or a comma list of them (`0,0.7,1`), each as `temperature` takes it, for
    argparse: none empty, none twice (0 and 0.0 are one temperature)."""
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"takes a number >= 0 (0: greedy) or a comma list of them, not {text!r}: "
                                         "an item is empty")
    values = []
    for part in parts:
        value = _number(part)
        if not 0.0 <= value < float("inf"):
            raise argparse.ArgumentTypeError(f"takes a number >= 0 (0: greedy) or a comma list of them, not {part!r}"
                                             + (f" (in {text!r})" if len(parts) > 1 else ""))
        if value in values:
            raise argparse.ArgumentTypeError(f"lists temperature {value:g} twice ({text!r}); give each once")
        values.append(value)
    return values


def sampling_temperature(text: str) -> float:
    """`temperature` where greedy decoding makes no sense: > 0, finite."""
    value = _number(text)
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"takes a number > 0, not {text!r}")
    return value


def _number(text: str) -> float:
    """`text` as a float, nan where it is not one (refused by the checks above)."""
    try:
        return float(text)
    except ValueError:
        return float("nan")


def top_p(text: str) -> float:
    """A nucleus-sampling probability mass in (0, 1], for argparse."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"takes a number in (0, 1], not {text!r}")
    return value


def add_runtime_arguments(parser: argparse.ArgumentParser, decode_rows_help: str, prefix: str = "") -> None:
    """The flags of a command that generates with the target through the runtime in this process (`prefix`
    names that back end where the command has another)."""
    parser.add_argument("--device", type=device_arg, default=None, help=f"{prefix}cuda, cuda:N or cpu (default: cuda:$LOCAL_RANK if present)")
    parser.add_argument("--dtype", choices=tuple(TORCH_DTYPES), default="bf16", help=f"{prefix}weights")
    parser.add_argument("--decode-rows", type=positive_int, default=None, help=f"{prefix}{decode_rows_help}")
    parser.add_argument("--kernels", default="auto", choices=KERNELS,
                        help=f"{prefix}auto (triton on CUDA when installed), triton or torch")
    parser.add_argument("--no-cuda-graphs", action="store_true", help=f"{prefix}plain eager steps")
    parser.add_argument("--no-compile", action="store_true",
                        help=f"{prefix}skip torch.compile of the decode step (starts faster, decodes slower)")
    parser.add_argument("--compile-scope", choices=COMPILE_SCOPES, default="layer", help=f"{prefix}{COMPILE_SCOPE_HELP}")


def generation_config(args: argparse.Namespace, target: TargetModel, rows: int, max_length: int,
                      stop_loops: bool = False) -> EngineConfig:
    """The runtime's settings for generating without a drafter, from `add_runtime_arguments`' flags and the
    command's --max-new-tokens, --temperature and --top-p: `rows` decoded at once, caches of `max_length`,
    rows ended inside a verbatim loop with `stop_loops`."""
    return EngineConfig(batch_size=rows, block_size=1, max_new_tokens=args.max_new_tokens, max_length=max_length,
                        temperature=args.temperature, top_p=args.top_p,
                        stop_token_ids=tuple(stop_token_ids(target.tokenizer, target.model.generation_config)),
                        kernels=args.kernels, cuda_graphs=not args.no_cuda_graphs,
                        compile=False if args.no_compile else None, compile_scope=args.compile_scope,
                        stop_loops=stop_loops)
