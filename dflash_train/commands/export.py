"""Export a drafter checkpoint (ours, a published z-lab one, or a Hub id) as the directory that
SGLang, vLLM and Transformers (remote code) load as is: config.json, bf16 model.safetensors,
dflash.py and a model card. The result is checked before it is published.

    dflash-train export runs/smollm2/checkpoints/step-00002000 --out exports/SmolLM2-135M-DFlash-b16 \\
        --target smollm2-135m-instruct --eval-report eval/report.json
    dflash-train export z-lab/Qwen3-8B-DFlash-b16 --out exports/qwen3-8b --target Qwen/Qwen3-8B
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash_train.checkpoint import export_checkpoint
from dflash_train.checkpoint.card import load_eval_reports
from dflash_train.commands.data_args import add_target_argument, positive_float
from dflash_train.outputs import EXPORTED, claim, holds_output


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="checkpoint directory or Hub id")
    parser.add_argument("--out", required=True, type=Path, help="output directory: new, empty, or an earlier export with --overwrite")
    add_target_argument(parser, required=False, use="the target to check the export against")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the files of an earlier export in --out (other files are kept)")
    parser.add_argument("--base-model", default=None, help="Hub id of the target for the model card")
    parser.add_argument("--repo-id", default=None, help="Hub repo the export will be pushed to (for the card)")
    parser.add_argument("--license", default=None, help="licence for the card's front matter (default apache-2.0)")
    parser.add_argument("--training-data", default=None, metavar="TEXT|FILE",
                        help="the card's Training data section: markdown text, or a .md/.txt file holding it")
    parser.add_argument("--eval-report", action="append", default=[], metavar="JSON",
                        help="eval report(s) to tabulate in the card (repeatable)")
    parser.add_argument("--max-shard-gb", type=positive_float, default=5.0, help="shard the weights above this size")


def training_data_text(value: str | None) -> str | None:
    """--training-data as the card's text: an existing .md or .txt file is read; a word ending in .md or .txt
    that names no file is refused (the card would show the path); anything else is the text itself."""
    if value is None or Path(value).suffix.lower() not in (".md", ".txt"):
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        if any(character.isspace() for character in value):
            return value  # a sentence that ends in a file name
        raise ValueError(f"--training-data {value}: no such file; give the file that describes the training "
                         "data, or the text itself")
    try:
        return path.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError as error:
        raise ValueError(f"--training-data {value} is not UTF-8 text ({error.reason}); save it as UTF-8") from error


def run(args: argparse.Namespace) -> int:
    card_info = {
        "base_model": args.base_model,
        "repo_id": args.repo_id,
        "license": args.license,
        "training_data": training_data_text(args.training_data),
        "eval": load_eval_reports(args.eval_report) or None,
    }
    out: Path = args.out
    claim(out, EXPORTED, inputs=[args.checkpoint, args.target, *args.eval_report], overwrite=args.overwrite,
          reusable=False, clear=False, why="holds an earlier export" if holds_output(out, EXPORTED) else None)

    # Written aside, then only an earlier export's files are replaced in `out` (claim has refused the rest).
    export_checkpoint(args.checkpoint, out, target=args.target, card_info=card_info, overwrite=True,
                      max_shard_bytes=int(args.max_shard_gb * 1024**3))
    files = sorted(p.name for p in out.iterdir() if EXPORTED.owns(p.name))
    print(f"exported {args.checkpoint} to {out} ({', '.join(files)}); passes dflash-train check")
    return 0
