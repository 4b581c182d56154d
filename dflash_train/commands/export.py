"""Export a drafter checkpoint (ours, a published z-lab one, or a Hub id) as the directory that
SGLang, vLLM and Transformers (remote code) load as is: config.json, bf16 model.safetensors,
dflash.py and a model card. The result is checked before it is published.

    dflash-train export runs/smollm2/checkpoints/step-00002000 --out exports/SmolLM2-135M-DFlash-b16 \\
        --target smollm2-135m-instruct --eval-report eval/report.json
    dflash-train export z-lab/Qwen3-8B-DFlash-b16 --out exports/qwen3-8b --target Qwen/Qwen3-8B
"""

from __future__ import annotations

import argparse

HELP = "export a drafter checkpoint for SGLang, vLLM and Transformers"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="checkpoint directory or Hub id")
    parser.add_argument("--out", required=True, help="output directory (must be new or empty)")
    parser.add_argument("--target", default=None, help="the target (alias, directory, .gguf or Hub id) to check against")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    parser.add_argument("--base-model", default=None, help="Hub id of the target for the model card")
    parser.add_argument("--repo-id", default=None, help="Hub repo the export will be pushed to (for the card)")
    parser.add_argument("--license", default=None, help="licence for the card's front matter (default apache-2.0)")
    parser.add_argument("--training-data", default=None, help="markdown describing the training data")
    parser.add_argument("--eval-report", action="append", default=[], metavar="JSON",
                        help="eval report(s) to tabulate in the card (repeatable)")
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="shard the weights above this size")


def run(args: argparse.Namespace) -> int:
    from dflash_train.checkpoint import export_checkpoint
    from dflash_train.checkpoint.card import load_eval_reports

    card_info = {
        "base_model": args.base_model,
        "repo_id": args.repo_id,
        "license": args.license,
        "training_data": args.training_data,
        "eval": load_eval_reports(args.eval_report) or None,
    }
    out = export_checkpoint(args.checkpoint, args.out, target=args.target, card_info=card_info,
                            overwrite=args.overwrite, max_shard_bytes=int(args.max_shard_gb * 1024**3))
    files = sorted(p.name for p in out.iterdir())
    print(f"exported {args.checkpoint} to {out} ({', '.join(files)}); passes dflash-train check")
    return 0
