"""Run the target over a prepared dataset and store its features for offline training.

    dflash-train extract --target smollm2-135m-instruct --data runs/prepared-smollm2 --out runs/features-smollm2
    dflash-train extract --target smollm2-135m-instruct --data runs/prepared-smollm2 --dtype fp8 \\
        --layer-ids 1,8,14,20,27 --out runs/features-smollm2-fp8
    dflash-train extract --verify --out runs/features-smollm2 --data runs/prepared-smollm2 \\
        --target smollm2-135m-instruct --recompute 4

The size is printed before anything is written, and the run refuses to start when the disk cannot hold
it. Shards are written atomically: rerun the same command after a kill to finish. Several processes
split the shards (`torchrun --nproc-per-node 8 -m dflash_train.cli extract ...` or --rank/--world-size).
--verify checks every shard (structure, counts, finite values), and with --data and --target also the
token ids and a --recompute sample of features.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dflash_train.commands.data_args import (
    TORCH_DTYPES,
    add_target_argument,
    device_arg,
    non_negative_int,
    positive_float,
    positive_int,
    resolve_device,
    tqdm_progress,
)
from dflash_train.data.prepared import check_tokenizer, load_prepared, tokenizer_hash
from dflash_train.features.extract import ExtractConfig, extract
from dflash_train.features.layer_ids import default_target_layer_ids, validate_target_layer_ids
from dflash_train.features.store import MANIFEST
from dflash_train.features.verify import verify_store
from dflash_train.json_files import json_object_or_none
from dflash_train.outputs import FEATURES, claim, foreign_entries, holds_output, remove_owned
from dflash_train.shards import rank_and_world
from dflash_train.target import TargetModel, load_target, target_fingerprint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="feature store directory (resumed if it exists)")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over in --out: remove a store made with other settings (one with the same "
                             "settings is resumed, so every rank may pass it); other files are kept")
    parser.add_argument("--data", type=Path, default=None, help="prepared dataset (from `dflash-train prepare`)")
    add_target_argument(parser, required=False, use="needed to extract, and by --verify --recompute")
    parser.add_argument("--layer-ids", default=None, help="comma-separated target layer ids (default: the "
                                                          "drafter's defaults for --num-draft-layers)")
    parser.add_argument("--num-draft-layers", type=positive_int, default=5)
    parser.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16", help="stored feature dtype")
    parser.add_argument("--target-dtype", choices=tuple(TORCH_DTYPES), default="bf16", help="target weights")
    parser.add_argument("--device", type=device_arg, default=None, help="cuda, cuda:N or cpu (default: cuda:$LOCAL_RANK if present)")
    parser.add_argument("--shard-gb", type=positive_float, default=0.5,
                        help="about this many GB per shard file (pinned host memory holds up to 2 x "
                             "--window-shards shards: one window computed while the one before is written)")
    parser.add_argument("--window-shards", type=positive_int, default=ExtractConfig.window_shards,
                        help="shards whose rows are micro-batched together: more rows sorted together pad less "
                             "and run fewer, fuller forwards (lower it, or --shard-gb, if host memory is short)")
    parser.add_argument("--rows-per-shard", type=positive_int, default=None,
                        help="rows per shard file instead of --shard-gb (default: an existing store's own)")
    parser.add_argument("--token-budget", type=positive_int, default=ExtractConfig.token_budget,
                        help="padded tokens per forward (lower it if the GPU runs out of memory)")
    parser.add_argument("--write-threads", type=positive_int, default=4,
                        help="shard files written at once (one thread copying into the page cache is slower "
                             "than the GPU, and one file takes one writer at a time)")
    parser.add_argument("--rank", type=non_negative_int, default=None, help="default: $RANK or 0")
    parser.add_argument("--world-size", type=positive_int, default=None, help="default: $WORLD_SIZE or 1")
    parser.add_argument("--verify", action="store_true", help="check an existing store instead of writing")
    parser.add_argument("--recompute", type=non_negative_int, default=0, help="with --verify: rows to recompute and compare")


def _layer_ids(args: argparse.Namespace, num_layers: int) -> list[int]:
    if args.layer_ids:
        try:
            ids = [int(x) for x in args.layer_ids.split(",")]
        except ValueError:
            raise ValueError(f"--layer-ids {args.layer_ids!r} is not a comma-separated list of integers") from None
        return validate_target_layer_ids(ids, num_layers)
    return default_target_layer_ids(num_layers, args.num_draft_layers)


def _verify(args: argparse.Namespace) -> int:
    dataset = load_prepared(args.data) if args.data else None
    target = None
    if args.target and args.recompute:
        target = load_target(args.target, dtype=TORCH_DTYPES[args.target_dtype], device=resolve_device(args.device))
    counts = verify_store(args.out, dataset, target, args.recompute, tqdm_progress("verify", "shards"))
    print(f"verify: {args.out} OK: {counts['shards']} shards, {counts['rows']:,} rows, {counts['tokens']:,} tokens")
    return 0


def _store_settings(config: ExtractConfig, target: TargetModel, num_rows: int) -> dict[str, Any]:
    """The manifest keys of a store that this run fixes before extracting (`extract` adds derived ones)."""
    fixed = {"format": "dflash-features-v1", "target_layer_ids": list(config.layer_ids),
             "hidden_size": target.hidden_size, "dtype": config.dtype, "num_rows": num_rows}
    return fixed if config.rows_per_shard is None else {**fixed, "rows_per_shard": config.rows_per_shard}


def _made_otherwise(out: Path, expected: dict[str, Any]) -> bool:
    """Whether the store in ``out`` was made with other settings than ``expected`` (no store: False)."""
    path = out / MANIFEST
    if not path.exists():
        return False
    found = json_object_or_none(path)
    if found is None or found.get("format") != expected["format"]:
        raise ValueError(f"{path} is not a feature store's manifest; move it away or pick another --out")
    return any(found.get(key) != value for key, value in expected.items())


def run(args: argparse.Namespace) -> int:
    if args.verify:
        return _verify(args)
    if args.data is None or args.target is None:
        raise ValueError("extract needs --data (a prepared dataset) and --target")
    rank, world = rank_and_world(args.rank, args.world_size)
    # Checked before the target loads; a store of other settings is recognised only once it has (below).
    claim(args.out, FEATURES, inputs=[args.data, args.target], overwrite=args.overwrite,
          reusable=holds_output(args.out, FEATURES) or not foreign_entries(args.out, FEATURES))
    dataset = load_prepared(args.data)
    target = load_target(args.target, dtype=TORCH_DTYPES[args.target_dtype], device=resolve_device(args.device))
    check_tokenizer(args.data, target.tokenizer, args.target)
    config = ExtractConfig(_layer_ids(args, target.num_layers), args.dtype, args.rows_per_shard, args.token_budget,
                           write_threads=max(1, args.write_threads), shard_bytes=int(args.shard_gb * 1e9),
                           window_shards=args.window_shards)
    settings = {"target": args.target, "target_hash": target_fingerprint(target.model),
                "target_dtype": args.target_dtype, "tokenizer_hash": tokenizer_hash(target.tokenizer),
                "vocab_size": target.vocab_size, "prepared": str(args.data)}
    if args.overwrite and _made_otherwise(args.out, {**settings, **_store_settings(config, target, len(dataset))}):
        remove_owned(args.out, FEATURES)
    extract(target, dataset, args.out, config, settings, rank, world, tqdm_progress("extract", "tok/s"))
    print(f"extract: shards of rank {rank}/{world} written to {args.out}; check them with "
          f"`dflash-train extract --verify --out {args.out}`")
    return 0
