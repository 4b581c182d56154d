"""Regenerate the responses of chat prompts with the target itself, resumably, split across ranks.

Plan (from the input and the settings alone, identical for every rank and every resumed run): prompts are
read, cut to the conversation up to the first user turn, deduplicated and tokenised with the chat template
(the same template and thinking setting as at serving). The rows, in input order, are cut into windows of
``plan_window_units`` units; within a window they are sorted longest prompt first, and cut into units of
``batch_size`` rows. Sorting within windows, not over the whole input, keeps the units in input order: the
first k units hold the first ~k x ``batch_size`` rows, so a run stopped early (the speedrun's time limit) has
answered a prefix of the input, with its mix of sources, not the input's longest prompts. The manifest
records the window, so a run planned otherwise (earlier runs sorted all rows at once) is not resumed into.
Unit ``k`` is one batch; rank ``r`` of ``w`` runs units ``k % w == r``; each finished unit is one shard
``part-<k>.jsonl`` written atomically. A resumed run skips units whose shard exists, so no row is lost or
duplicated, and a unit's output depends only on its rows and ``seed + k``: a resumed run writes exactly
what an uninterrupted one would have. With ``turns`` > 1 the conversations' later user turns
are answered too, one round per turn, each conditioned on the target's own earlier answers
(``dflash_train.regeneration.turns``). With ``samples_per_prompt`` K > 1 (sampling only) each prompt becomes K rows,
row ids ``prompt * K + sample``: the plan fixes every row's id and unit, so each sample draws from its own
seed, the same in a resumed run, and K answers to one prompt differ.

Output rows: ``{"messages": [...prompt, {"role": "assistant", "content": ...}], "finish_reason",
"prompt_tokens", "completion_tokens", "source", "source_index", "row_id"}`` — an OpenAI-messages corpus
that ``dflash-train prepare`` reads directly. ``source`` and ``source_index`` are the prompt's own labels where
its record has them (a ``pack`` file mixes named sources), else the corpus name and the record's index; prepare
keeps them, so training reports its validation per source.

Throughput: after every shard a process rewrites ``regen_stats.json`` beside the shards (one process; with
several, each rank its own ``regen_stats.rank<r>.json``): units, rows, answer and prompt tokens, finish reasons,
for this run and for every shard present, and answer tokens per second over the decoding time and over the time
since the command started. A run stopped by a kill leaves the figures of its last shard.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path
from typing import Any, Protocol

from dflash_train.atomic import write_atomically, write_json_atomically
from dflash_train.data.chat import ChatTokenizer, template_hash
from dflash_train.json_files import json_object_or_none
from dflash_train.prompts.corpora import CorpusSpec, open_corpus
from dflash_train.prompts.messages import iter_messages, record_label
from dflash_train.prompts.records import BadRecord, Message, prompt_messages
from dflash_train.quality import DataReport
from dflash_train.regeneration.turns import (
    PromptRow,
    continue_conversations,
    count_turns,
    read_turn,
    turn_directory,
    wait_for_turn,
)
from dflash_train.shards import (
    REGEN_MANIFEST,
    check_same_settings,
    regenerated_files,
    regenerated_shard_path,
)

PLAN_BATCH = 4096  # prompts tokenised per tokenizer call while planning: enough to keep every core busy
# Units per window of input rows sorted by length: the runtime refills its rows continuously, so a few units'
# worth of rows sorted together keep most of the padding a global sort saves, and a stopped run a prefix.
PLAN_WINDOW_UNITS = 8


@dataclass
class Completion:
    text: str
    finish_reason: str
    completion_tokens: int


class Backend(Protocol):
    def complete(self, rows: list[PromptRow], seed: int) -> list[Completion]: ...


@dataclass
class RegenerateConfig:
    sources: list[CorpusSpec]
    max_new_tokens: int = 1024
    temperature: float = 0.0
    seed: int = 0
    thinking: bool | None = None
    batch_size: int = 64
    max_prompt_tokens: int = 2048
    dedupe: bool = True
    settings: dict[str, Any] = field(default_factory=dict)  # recorded; a resume must match them
    turns: int | None = 1  # user turns answered per conversation (None: all of them)
    turn_wait_seconds: float = 3600.0  # how long a rank waits for the other ranks to finish a turn
    samples_per_prompt: int = 1  # answers sampled per prompt, each a row (and conversation) of its own
    plan_window_units: int = PLAN_WINDOW_UNITS  # units of consecutive input rows sorted by length together
    started: float = field(default_factory=time.time)  # when the command started: load and planning count too

    def __post_init__(self) -> None:
        if self.plan_window_units < 1:
            raise ValueError(f"plan_window_units {self.plan_window_units}: give 1 or more")
        if self.samples_per_prompt < 1:
            raise ValueError(f"--samples-per-prompt {self.samples_per_prompt}: give 1 or more")
        if self.samples_per_prompt > 1 and self.temperature <= 0:
            raise ValueError(f"--samples-per-prompt {self.samples_per_prompt} needs --temperature > 0: greedy "
                             "answers to one prompt are all the same")


def plan_prompts(chat: ChatTokenizer, config: RegenerateConfig) -> tuple[list[PromptRow], DataReport]:
    """The rows to answer, in input order, and the report of the prompts read and dropped. Prompts are
    rendered one by one, then tokenised ``PLAN_BATCH`` at a time (one tokenizer call spreads a list over the
    cores); a prompt's fate still depends only on the prompts before it, as one at a time."""
    report = DataReport("regenerate: prompts")
    rows: list[PromptRow] = []
    seen: set[bytes] = set()
    for batch in _batches(_rendered(chat, config, report), PLAN_BATCH):
        for candidate, ids in zip(batch, chat.encode_texts([c.text for c in batch]), strict=True):
            row = _admitted(candidate, ids, len(rows), config, seen, report)
            if row is not None:
                rows.append(row)
    return fan_out(rows, config.samples_per_prompt, report), report


@dataclass
class _Candidate:
    """A prompt rendered with the chat template, waiting for its tokens."""

    prompt: list[Message]
    later: list[str]  # the conversation's later user turns (multi-turn regeneration)
    text: str
    source: str
    index: int


def _rendered(chat: ChatTokenizer, config: RegenerateConfig, report: DataReport) -> Iterator[_Candidate]:
    """Every prompt the template renders, in input order; the records, special-token texts and template
    refusals dropped on the way are counted in ``report``."""
    multi_turn = config.turns != 1  # then the whole conversation must be well-formed, not only its start
    for spec in config.sources:
        corpus = open_corpus(spec)
        for index, record, messages in iter_messages(corpus, spec, report, prompt_only=not multi_turn):
            prompt = prompt_messages(messages)
            later = [m["content"] for m in messages if m["role"] == "user"][1:] if multi_turn else []
            try:
                chat.check_no_special_text(prompt + [{"role": "user", "content": text} for text in later])
                text = chat.render(prompt, add_generation_prompt=True)
            except BadRecord as bad:
                report.drop(bad.reason)
                continue
            yield _Candidate(prompt, later, text, *record_label(record, corpus.name, index))


def _admitted(candidate: _Candidate, ids: list[int], row_id: int, config: RegenerateConfig, seen: set[bytes],
              report: DataReport) -> PromptRow | None:
    """The row of a tokenised prompt, or None (counted) when it repeats a kept prompt or is too long. Only
    kept prompts are remembered: a repeat of a prompt dropped as too long is too long again."""
    key = hashlib.sha1(json.dumps([candidate.prompt, candidate.later], sort_keys=True).encode()).digest()
    if config.dedupe and key in seen:
        report.drop("duplicate_prompt")
        return None
    if len(ids) > config.max_prompt_tokens:
        report.drop("prompt_too_long")
        return None
    seen.add(key)
    report.kept += 1
    return PromptRow(row_id, candidate.prompt, ids, candidate.source, candidate.index, candidate.later)


def _batches(items: Iterator[_Candidate], size: int) -> Iterator[list[_Candidate]]:
    while batch := list(islice(items, size)):
        yield batch


def fan_out(rows: list[PromptRow], samples: int, report: DataReport) -> list[PromptRow]:
    """``samples`` rows per prompt, with ids ``prompt * samples + sample``: consecutive, so that a prompt's
    samples share a unit (one prompt length) and their ids, which seed their draws, depend on the input only."""
    if samples == 1:
        return rows
    report.totals[f"rows: {samples} samples per prompt"] = len(rows) * samples
    return [replace(row, row_id=row.row_id * samples + k) for row in rows for k in range(samples)]


def plan_units(rows: list[PromptRow], batch_size: int, window_units: int = PLAN_WINDOW_UNITS) -> list[list[int]]:
    """Row indices of each unit, ``batch_size`` per unit: windows of ``window_units`` units of consecutive
    rows, in input order, each sorted longest prompt first (ties by input order, which keeps a prompt's
    samples together). A window is whole units, so no unit mixes two windows."""
    window = batch_size * window_units
    windows = (range(start, min(start + window, len(rows))) for start in range(0, len(rows), window))
    order = [i for rows_in in windows for i in sorted(rows_in, key=lambda i: (-len(rows[i].prompt_ids), i))]
    return [order[i: i + batch_size] for i in range(0, len(order), batch_size)]


def _start(backend: Backend, batch: list[PromptRow], seed: int) -> Callable[[], list[Completion]]:
    """Start a unit; the returned call waits for its completions. Back ends with ``start`` (the server
    back end) begin at once, so several units can be in flight; the others run when waited for. Carried
    rows (nothing to answer in this round) are not sent."""
    asked = [row for row in batch if row.carried is None]
    if not asked:
        return lambda: []
    start = getattr(backend, "start", None)
    return start(asked, seed) if start is not None else (lambda: backend.complete(asked, seed))


STATS_FILE = "regen_stats.json"  # not a shard's name: prepare reads part-*.jsonl only


def stats_path(out_dir: Path, rank: int, world: int) -> Path:
    """One file per process, so that no two ranks rewrite the same file."""
    return out_dir / (STATS_FILE if world == 1 else f"regen_stats.rank{rank}.json")


@dataclass
class Tally:
    """Counts over output rows."""

    units: int = 0
    rows: int = 0
    answer_tokens: int = 0
    prompt_tokens: int = 0
    finish_reasons: Counter[str] = field(default_factory=Counter)

    def add(self, rows: list[dict[str, Any]]) -> None:
        self.units += 1
        self.rows += len(rows)
        for row in rows:
            self.answer_tokens += row.get("completion_tokens", 0)
            self.prompt_tokens += row.get("prompt_tokens", 0)
            self.finish_reasons[str(row.get("finish_reason"))] += 1

    def as_dict(self) -> dict[str, Any]:
        return {"units": self.units, "rows": self.rows, "answer_tokens": self.answer_tokens,
                "prompt_tokens": self.prompt_tokens, "finish_reasons": dict(sorted(self.finish_reasons.items()))}


@dataclass
class RunStats:
    """This run's figures (its rates count only its own units) and the totals of every shard present."""

    path: Path
    num_units: int
    command_started: float
    decoding_started: float = field(default_factory=time.time)
    run: Tally = field(default_factory=Tally)
    total: Tally = field(default_factory=Tally)

    @classmethod
    def start(cls, out_dir: Path, rank: int, world: int, num_units: int, command_started: float) -> RunStats:
        """Counts the shards already present (a resumed run's) and writes the file at once, so that an
        earlier run's figures never stand for this one's."""
        stats = cls(stats_path(out_dir, rank, world), num_units, command_started)
        for shard in regenerated_files(out_dir):
            stats.total.add([json.loads(line) for line in shard.read_bytes().splitlines() if line.strip()])
        stats.decoding_started = time.time()  # reading earlier shards is start-up, not decoding
        stats.write()
        return stats

    def record(self, written: list[dict[str, Any]], answered: list[dict[str, Any]]) -> None:
        """A finished shard: all its rows count in the totals, the rows answered now (not carried from an
        earlier turn) in this run's figures."""
        self.total.add(written)
        self.run.add(answered)
        self.write()

    def write(self) -> None:
        now = time.time()
        decoding, overall = now - self.decoding_started, now - self.command_started
        write_json_atomically(self.path, {
            "num_units": self.num_units, "this_run": self.run.as_dict(), "all_shards": self.total.as_dict(),
            "command_started": self.command_started, "decoding_seconds": round(decoding, 3),
            "command_seconds": round(overall, 3),
            "answer_tokens_per_second_decoding": round(self.run.answer_tokens / max(decoding, 1e-9), 1),
            "answer_tokens_per_second_overall": round(self.run.answer_tokens / max(overall, 1e-9), 1),
        })


def latest_stats(out_dir: Path, rank: int, world: int, command_started: float) -> dict[str, Any] | None:
    """The stats this command wrote last (in ``out_dir`` or, multi-turn, a turn's folder), or None when it
    wrote none: an earlier run's file does not count."""
    name = stats_path(out_dir, rank, world).name
    found: list[tuple[float, dict[str, Any]]] = []
    for path in [out_dir / name, *out_dir.glob(f"turns/turn-*/{name}")]:
        stats = json_object_or_none(path)
        if stats is not None and stats.get("command_started") == command_started:
            found.append((path.stat().st_mtime, stats))
    return max(found, key=lambda item: item[0])[1] if found else None


def stopped_line(stats: dict[str, Any] | None) -> str:
    """One line for a run stopped early: what it finished, at what speed, and how to use it."""
    kept = "the finished shards are kept — prepare them with --allow-unfinished"
    if stats is None:
        return f"regenerate: stopped before any shard was written by this run; {kept}"
    run, total = stats["this_run"], stats["all_shards"]
    resumed = f" ({run['units']} by this run)" if run["units"] != total["units"] else ""
    return (f"regenerate: stopped after {total['units']} of {stats['num_units']} units{resumed}: "
            f"{run['answer_tokens']:,} answer tokens in {stats['command_seconds']:.0f} s, "
            f"{stats['answer_tokens_per_second_overall']:,.0f} tokens/s "
            f"({stats['answer_tokens_per_second_decoding']:,.0f} while decoding); {kept}")


def run_units(
    backend: Backend, rows: list[PromptRow], units: list[list[int]], out_dir: Path, rank: int, world: int,
    seed: int, progress: Callable[[int, int, float], None] | None = None, command_started: float | None = None,
) -> int:
    """Run this rank's unfinished units, in order, up to ``backend.window`` at a time (so a server is kept
    busy while a unit's slowest rows finish); returns the number of tokens generated. The stats file is
    rewritten after every shard (``command_started``: default now), and left alone when nothing is to run."""
    todo = [k for k in range(len(units)) if k % world == rank and not regenerated_shard_path(out_dir, k).exists()]
    # Nothing to run (a finished run started again): the figures of the run that decoded are kept.
    stats = RunStats.start(out_dir, rank, world, len(units), command_started or time.time()) if todo else None
    window = max(1, getattr(backend, "window", 1))
    generated, done, last_finished = 0, 0, 0.0
    in_flight: deque[tuple[int, list[PromptRow], Callable[[], list[Completion]], float]] = deque()
    if progress:
        progress(0, len(todo), 0.0)
    for k in [*todo, None]:
        if k is not None:
            batch = [rows[i] for i in units[k]]
            in_flight.append((k, batch, _start(backend, batch, seed + k), time.perf_counter()))
        while in_flight and (len(in_flight) >= window or k is None):
            unit, batch, wait, started = in_flight.popleft()
            completions = wait()
            answers = iter(completions)
            written = [r.carried if r.carried is not None else _output_row(r, next(answers)) for r in batch]
            lines = [json.dumps(row, ensure_ascii=False) for row in written]
            write_atomically(regenerated_shard_path(out_dir, unit),
                             lambda tmp, lines=lines: tmp.write_text("\n".join(lines) + "\n"))
            if stats is not None:
                stats.record(written, [row for r, row in zip(batch, written, strict=True) if r.carried is None])
            tokens = sum(c.completion_tokens for c in completions)
            generated, done = generated + tokens, done + 1
            # A unit in a window of several waits behind the others: its own time runs from the later of its
            # start and the previous unit's end (since its start alone, the rate read several times too low).
            now = time.perf_counter()
            if progress:
                progress(done, len(todo), tokens / max(now - max(started, last_finished), 1e-9))
            last_finished = now
    return generated


def _output_row(row: PromptRow, completion: Completion) -> dict[str, Any]:
    return {
        "row_id": row.row_id,
        "messages": [*row.messages, {"role": "assistant", "content": completion.text}],
        "finish_reason": completion.finish_reason,
        "prompt_tokens": len(row.prompt_ids),
        "completion_tokens": completion.completion_tokens,
        "source": row.source,
        "source_index": row.source_index,
    }


def manifest_settings(chat: ChatTokenizer, config: RegenerateConfig, num_rows: int, num_units: int) -> dict[str, Any]:
    return {
        "format": "dflash-regenerated-v1",
        "chat_template_hash": template_hash(chat.tokenizer),
        "thinking": config.thinking,
        "temperature": config.temperature,
        "max_new_tokens": config.max_new_tokens,
        "seed": config.seed,
        "batch_size": config.batch_size,
        "sources": [spec.source for spec in config.sources],
        "num_rows": num_rows,
        "num_units": num_units,
        # Always recorded: a manifest without it was planned by one sort of all rows, and differs from any value.
        "plan_window_units": config.plan_window_units,
        # only when above 1, so that runs started before it was recorded still resume
        **({"samples_per_prompt": config.samples_per_prompt} if config.samples_per_prompt != 1 else {}),
        **config.settings,
    }


def regenerate(
    backend: Backend, chat: ChatTokenizer, config: RegenerateConfig, out_dir: Path, rank: int = 0, world: int = 1,
    progress: Callable[[int, int, float], None] | None = None,
) -> dict[str, Any]:
    """Plan, check/write the manifest, run this rank's units, turn after turn (``config.turns``); returns
    the manifest of the last turn run, with counts (``complete`` once the final turn is)."""
    first, report = plan_prompts(chat, config)
    if not first:
        raise ValueError(report.nothing_kept("prompts", [spec.source for spec in config.sources]))
    rounds = count_turns(first, config.turns)
    rows, tokens, manifest, units = first, 0, {}, []
    for turn in range(1, rounds + 1):
        if turn > 1:
            previous = turn_directory(out_dir, turn - 1, rounds)
            if not wait_for_turn(previous, len(units), config.turn_wait_seconds):
                print(f"regenerate: turn {turn} starts once every shard of turn {turn - 1} is in {previous}; "
                      "run this command again when the other ranks have written theirs", flush=True)
                break
            rows = continue_conversations(chat, config.max_prompt_tokens, first, read_turn(previous), turn, report)
        units = plan_units(rows, config.batch_size, config.plan_window_units)
        extra = {"turns": config.turns, "turn": turn, "rounds": rounds} if config.turns != 1 else {}
        settings = {**manifest_settings(chat, config, len(rows), len(units)), **extra}
        manifest, generated = run_turn(backend, rows, units, turn_directory(out_dir, turn, rounds), settings,
                                       report, rank, world, config.seed + (turn - 1) * 1_000_003, progress,
                                       config.started)
        tokens += generated
    report.totals["tokens generated by this run"] = tokens
    report.print()
    return manifest


def run_turn(backend: Backend, rows: list[PromptRow], units: list[list[int]], turn_dir: Path,
             settings: dict[str, Any], report: DataReport, rank: int, world: int, seed: int,
             progress: Callable[[int, int, float], None] | None,
             command_started: float | None = None) -> tuple[dict[str, Any], int]:
    """One round: check/write its manifest, run this rank's units, mark it complete when it is."""
    manifest_path = turn_dir / REGEN_MANIFEST
    check_same_settings(manifest_path, settings, "regenerated responses", "regenerate")
    if rank == 0 and not manifest_path.exists():
        write_json_atomically(manifest_path, {**settings, "prompts": report.as_dict()})
    tokens = run_units(backend, rows, units, turn_dir, rank, world, seed, progress, command_started)
    finished = len(regenerated_files(turn_dir))
    manifest = {**settings, "prompts": report.as_dict(), "units_finished": finished,
                "complete": finished == len(units)}
    if manifest["complete"]:
        write_json_atomically(manifest_path, manifest)
    return manifest, tokens
