"""Push an exported drafter directory to the Hugging Face Hub in one commit (the repo, and the
branch given by --revision, are created if needed). The directory must pass `dflash-train check`.
The token comes from HF_TOKEN or `hf auth login`.

    dflash-train push exports/SmolLM2-135M-DFlash-b16 --repo-id my-org/SmolLM2-135M-DFlash-b16 --dry-run
    dflash-train push exports/SmolLM2-135M-DFlash-b16 --repo-id my-org/SmolLM2-135M-DFlash-b16 --private
"""

from __future__ import annotations

import argparse

from dflash_train.checkpoint.push import plan_push, push_checkpoint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="exported drafter directory")
    parser.add_argument("--repo-id", required=True, help="ORG/NAME on the Hub")
    parser.add_argument("--private", action="store_true", help="create the repo as private")
    parser.add_argument("--revision", default=None, help="branch to push to (created if missing)")
    parser.add_argument("--message", default=None, help="commit message")
    parser.add_argument("--dry-run", action="store_true", help="list what would be uploaded, upload nothing")


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        plan = plan_push(args.directory, args.repo_id)
        for name, size in plan.files:
            print(f"{size:>14,d}  {name}")
        where = f"{args.repo_id}@{args.revision}" if args.revision else args.repo_id
        print(f"would upload {len(plan.files)} files ({plan.total_bytes / 1e6:.1f} MB) to {where}; nothing sent")
        return 0
    url = push_checkpoint(args.directory, args.repo_id, private=args.private, revision=args.revision,
                          commit_message=args.message)
    print(f"pushed {args.directory} to {args.repo_id}: {url}")
    return 0
