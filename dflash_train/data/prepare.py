"""Corpora -> tokenised chats with loss masks, saved as a prepared dataset (see ``prepared.py``).

Rows are validated (``prompts/records.py``), rendered and masked with the target's chat template (``chat.py``),
cut to ``max_length`` keeping whole assistant spans where possible, and dropped when fewer than
``min_supervised`` (``2 * block_size``) tokens remain supervised. Rows whose prompt turns share a word
13-gram with an eval set are dropped as ``overlaps_eval_set`` (``prompts/decontaminate.py``; the metadata lists the
eval sets); a conversation identical to an earlier one (several sampled answers to a prompt can be) as
``duplicate_conversation``, unless ``dedupe`` is off. Every drop is counted by reason, and a reason that drops more than 5 % of the rows gets a
warning line in the summary. A conversation whose template renders some turns differently once later turns
follow gives those turns rows of their own (``chat.py``). A row is labelled with its record's own ``source``
and ``source_index`` where the record carries them (``pack`` mixes named sources in one file; ``regenerate``
keeps the labels of its prompts), else with the corpus name and the record's index: training's validation
reports one τ̂ per label (``training/source_metrics.py``).
``show`` prints rows with their supervised text marked, writing nothing.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import tempfile
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from itertools import chain, islice
from pathlib import Path
from typing import Any

import datasets
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dflash_train.atomic import write_json_atomically
from dflash_train.data.chat import ChatTokenizer, TokenizedChat, fit_length, marked_text, template_hash
from dflash_train.data.loop_trim import UNFINISHED, trim_tail_loop
from dflash_train.data.prepared import METADATA_FILE, tokenizer_hash
from dflash_train.json_files import json_object_or_none, read_json_object
from dflash_train.outputs import PREPARED, claim, publish
from dflash_train.prompts.corpora import Corpus, CorpusSpec, open_corpus
from dflash_train.prompts.decontaminate import DROP_REASON as EVAL_OVERLAP
from dflash_train.prompts.decontaminate import EvalIndex, project_eval_index
from dflash_train.prompts.messages import Label, iter_messages, record_label
from dflash_train.prompts.records import BadRecord, Message
from dflash_train.quality import EXCLUDED_SOURCE, OVER_SOURCE_CAP, DataReport
from dflash_train.shards import REGEN_MANIFEST, REGENERATE_AGAIN

DUPLICATE_CONVERSATION = "duplicate_conversation"
PARALLEL_MIN_ROWS = 4096  # records below which a pool costs more to start (fork, first calls) than it saves
POOL_CHUNK = 128  # records per task sent to a pool worker


@dataclass
class PrepareConfig:
    sources: list[CorpusSpec]
    max_length: int = 3072
    block_size: int = 16
    thinking: bool | None = None
    train_turns: str = "all"
    target_name: str = "target"
    extra_metadata: dict[str, Any] = field(default_factory=dict)
    decontaminate: bool = True  # drop rows whose prompt turns share a word 13-gram with an eval set
    workers: int = 1  # processes tokenising the records (1: this one); the rows written are the same
    parallel_min_rows: int = PARALLEL_MIN_ROWS  # fewer records are tokenised here: a pool would not repay its start
    trim_loops: bool = False  # cut answers the token cap stopped inside a verbatim loop to two copies (loop_trim.py)
    exclude_sources: tuple[str, ...] = ()  # records labelled with one of these sources are left out
    # (source, n): at most the first n records of the source go on to tokenising (a mix's share made smaller
    # without regenerating; tokenising's own drops can leave fewer rows)
    source_caps: tuple[tuple[str, int], ...] = ()
    dedupe: bool = True  # drop a conversation identical to an earlier one (sampled answers can repeat)

    @property
    def min_supervised(self) -> int:
        return 2 * self.block_size


def settings_of_regenerated(sources: list[CorpusSpec], tokenizer: PreTrainedTokenizerBase,
                            thinking: bool | None) -> bool | None:
    """The thinking setting to tokenise with: regenerated responses must be rendered with the template and
    thinking setting they were generated with (their manifest records both)."""
    for spec in sources:
        manifest_path = Path(spec.source) / REGEN_MANIFEST
        if not manifest_path.is_file():
            continue
        manifest = read_json_object(manifest_path, REGENERATE_AGAIN)
        if manifest.get("chat_template_hash") != template_hash(tokenizer):
            raise ValueError(f"{manifest_path}: responses generated with another chat template than this target's; "
                             f"prepare them with the target that generated them")
        if thinking is None:
            thinking = manifest.get("thinking")
        elif manifest.get("thinking") is not None and manifest["thinking"] != thinking:
            raise ValueError(f"{manifest_path}: generated with thinking {'on' if manifest['thinking'] else 'off'}; "
                             f"prepare with the same --thinking")
    return thinking


def default_workers() -> int:
    """Processes for tokenising: one per core this process may use, at most 16. This process still reads
    every record and writes every row alone, which caps what more workers can add."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, 16))


def tokenized_rows(chat: ChatTokenizer, config: PrepareConfig, report: DataReport) -> Iterator[dict[str, Any]]:
    """The rows to write, in input order. With ``config.workers`` > 1 and at least ``parallel_min_rows``
    records, the records are tokenised in a pool of processes; rows and report are those of one process."""
    evals = project_eval_index() if config.decontaminate else None
    for where, outcome in _tokenized(chat, config, evals, _records(config, report)):
        yield from _account(outcome, where, report)


# A record's corpus, index and label, kept in this process to count its drops and label its rows.
Where = tuple[Corpus, int, Label]
Work = tuple[list[Message], str | None]  # what a worker needs of a record: its messages and finish reason


def _records(config: PrepareConfig, report: DataReport) -> Iterator[tuple[Where, Work]]:
    """The records to tokenise, in input order; excluded sources and repeated conversations are counted as
    drops here, in this process, so the first copy of a conversation is the one kept whatever the workers."""
    seen: set[bytes] | None = set() if config.dedupe else None
    room = dict(config.source_caps)  # records each capped source may still pass on
    for spec in config.sources:
        corpus = open_corpus(spec)
        for index, record, messages in iter_messages(corpus, spec, report):
            label = record_label(record, corpus.name, index)
            reason = EXCLUDED_SOURCE if label[0] in config.exclude_sources else None
            if reason is None and seen is not None:
                key = conversation_key(messages, record.get("finish_reason") in UNFINISHED)
                reason = DUPLICATE_CONVERSATION if key in seen else None
                seen.add(key)
            if reason is None and label[0] in room:  # a repeat never uses up a capped source's room
                if room[label[0]] == 0:
                    reason = OVER_SOURCE_CAP
                else:
                    room[label[0]] -= 1
            if reason is not None:  # never tokenised
                report.count_source(label[0], reason)
                report.drop(reason, corpus.location(index))
                continue
            yield (corpus, index, label), (messages, record.get("finish_reason"))


def conversation_key(messages: list[Message], unfinished: bool) -> bytes:
    """A training conversation's identity: a 128-bit hash (16 bytes a record held, not its text) of its
    messages and of whether its last answer was cut off (then no end of turn is supervised: another row)."""
    text = json.dumps([messages, unfinished], sort_keys=True, ensure_ascii=False)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


@dataclass
class Outcome:
    """What tokenising one record gave: a drop reason, or the samples kept."""

    drop: str | None = None
    samples: list[TokenizedChat] = field(default_factory=list)
    not_reproducible: int | None = None  # turns the template cannot show; None when it was not asked
    too_short: int = 0  # rows of single turns dropped as too short
    trimmed: bool = False  # its last answer ended in a loop, cut to two copies (--trim-loops)


def tokenize_record(chat: ChatTokenizer, config: PrepareConfig, evals: EvalIndex | None,
                    messages: list[Message], finish_reason: str | None) -> Outcome:
    if evals is not None and evals.overlaps(messages):
        return Outcome(EVAL_OVERLAP)
    trimmed, unfinished = False, finish_reason in UNFINISHED  # cut at the cap, or ended inside a loop
    if config.trim_loops and unfinished and messages and messages[-1]["role"] == "assistant":
        content = trim_tail_loop(messages[-1]["content"])
        trimmed = content != messages[-1]["content"]
        messages = [*messages[:-1], {**messages[-1], "content": content}]
    try:
        conversation = chat.tokenize(messages, config.train_turns, unfinished)
    except BadRecord as bad:
        return Outcome(bad.reason)
    samples = [fit_length(sample, config.max_length) for sample in conversation.samples]
    kept = [sample for sample in samples if sample.num_supervised >= config.min_supervised]
    if not kept:
        too_long = any(sample.truncated for sample in samples)
        return Outcome("too_long" if too_long else "too_few_supervised_tokens",
                       not_reproducible=conversation.turns_not_reproducible)
    return Outcome(None, kept, conversation.turns_not_reproducible, len(samples) - len(kept), trimmed)


def _account(outcome: Outcome, where: Where, report: DataReport) -> Iterator[dict[str, Any]]:
    """Count ``outcome`` in ``report`` and yield its rows."""
    corpus, index, label = where
    report.count_source(label[0], outcome.drop or "kept")
    if outcome.not_reproducible is not None:  # counted, 0 included, for every record the template rendered
        report.totals["turns not reproducible by the template"] += outcome.not_reproducible
    if outcome.drop is not None:
        report.drop(outcome.drop, corpus.location(index))
        return
    report.kept += 1
    if outcome.trimmed:
        report.totals["answers cut at a tail loop"] += 1
    if outcome.too_short:  # a turn in a row of its own (see chat.py) can be short alone
        report.totals["rows of single turns dropped as too short"] += outcome.too_short
    for sample in outcome.samples:
        yield _row(sample, label, report)


def _tokenized(chat: ChatTokenizer, config: PrepareConfig, evals: EvalIndex | None,
               records: Iterator[tuple[Where, Work]]) -> Iterator[tuple[Where, Outcome]]:
    """Each record's outcome, in order: in a pool when asked and the input is large enough to repay starting
    it (the first ``parallel_min_rows`` records are read to find out), else here."""
    if config.workers > 1:
        head = list(islice(records, config.parallel_min_rows))
        records = chain(head, records)
        if len(head) >= config.parallel_min_rows:
            yield from _in_pool(chat, config, evals, records)
            return
    for where, (messages, finish_reason) in records:
        yield where, tokenize_record(chat, config, evals, messages, finish_reason)


def _in_pool(chat: ChatTokenizer, config: PrepareConfig, evals: EvalIndex | None,
             records: Iterator[tuple[Where, Work]]) -> Iterator[tuple[Where, Outcome]]:
    """Outcomes from ``config.workers`` forked processes, ``POOL_CHUNK`` records a task, in input order. A
    few tasks per worker are in flight, so workers never wait on this process, nor does memory grow with
    the input. Forked workers inherit the tokenizer and eval index instead of unpickling them."""
    pool = ProcessPoolExecutor(config.workers, multiprocessing.get_context("fork"),
                               initializer=_start_worker, initargs=(chat, config, evals))
    pending: deque[tuple[tuple[Where, ...], Future[list[Outcome]]]] = deque()
    try:
        while chunk := list(islice(records, POOL_CHUNK)):
            wheres, works = zip(*chunk, strict=True)
            pending.append((wheres, pool.submit(_tokenize_chunk, list(works))))
            if len(pending) >= 4 * config.workers:
                yield from _results(pending.popleft())
        while pending:
            yield from _results(pending.popleft())
    finally:
        pool.shutdown(cancel_futures=True)


def _results(task: tuple[tuple[Where, ...], Future[list[Outcome]]]) -> Iterator[tuple[Where, Outcome]]:
    wheres, future = task
    yield from zip(wheres, future.result(), strict=True)  # a worker's ValueError is raised here, as it was


_WORKER: dict[str, Any] = {}  # a pool worker's tokenizer, config and eval index


def _start_worker(chat: ChatTokenizer, config: PrepareConfig, evals: EvalIndex | None) -> None:
    # The processes are the parallelism: a Rust thread pool in each as well would oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(chat=chat, config=config, evals=evals)


def _tokenize_chunk(works: list[Work]) -> list[Outcome]:
    chat, config, evals = _WORKER["chat"], _WORKER["config"], _WORKER["evals"]
    return [tokenize_record(chat, config, evals, messages, finish_reason) for messages, finish_reason in works]


def _row(sample: TokenizedChat, label: Label, report: DataReport) -> dict[str, Any]:
    report.totals["rows written"] += 1  # more than the rows kept when turns get rows of their own
    report.totals["rows truncated"] += sample.truncated
    report.totals["tokens"] += len(sample.input_ids)
    report.totals["supervised tokens"] += sample.num_supervised
    return {
        "input_ids": sample.input_ids,
        "loss_mask": sample.loss_mask,
        "num_supervised": sample.num_supervised,
        "source": label[0],
        "source_index": label[1],
    }


def show(tokenizer: PreTrainedTokenizerBase, config: PrepareConfig, count: int) -> DataReport:
    """Print the first ``count`` rows as ``prepare`` would write them, the supervised text between ⟦ ⟧, so a
    new target's template and masks can be checked by eye; nothing is written. Returns the report of the rows
    read for them."""
    config.thinking = settings_of_regenerated(config.sources, tokenizer, config.thinking)
    chat = ChatTokenizer(tokenizer, config.thinking, config.target_name)
    report = DataReport(f"prepare --show {count} (nothing written): the rows read for them")
    print("⟦...⟧ marks the supervised tokens (the loss mask)")
    serial = replace(config, workers=1)  # a pool would read ahead, and the report counts the rows read
    for number, row in enumerate(islice(tokenized_rows(chat, serial, report), count), 1):
        mask = row["loss_mask"]
        spans = sum(1 for k, m in enumerate(mask) if m and (k == 0 or not mask[k - 1]))
        print(f"── row {number}: {row['source']} #{row['source_index']}, {len(mask):,} tokens, "
              f"{row['num_supervised']:,} supervised in {spans} span{'s' * (spans != 1)} ──")
        print(marked_text(tokenizer, row["input_ids"], mask))
    return report


def prepare(tokenizer: PreTrainedTokenizerBase, config: PrepareConfig, out_dir: Path,
            overwrite: bool = False) -> DataReport:
    """Write the prepared dataset to ``out_dir`` and return the report. The dataset is built aside and moved
    in once complete; an earlier dataset from the same inputs is replaced, any other non-empty folder is
    refused unless ``overwrite`` (then only the earlier dataset's files are replaced; see ``outputs.py``)."""
    config.thinking = settings_of_regenerated(config.sources, tokenizer, config.thinking)
    chat = ChatTokenizer(tokenizer, config.thinking, config.target_name)  # refuses a bad setting first
    claim(out_dir, PREPARED, inputs=[spec.source for spec in config.sources] + [config.target_name],
          overwrite=overwrite, reusable=_same_settings(out_dir, _settings(tokenizer, config)), clear=False)
    report = DataReport(f"prepare -> {out_dir}")
    features = datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
        "num_supervised": datasets.Value("int32"),
        "source": datasets.Value("string"),
        "source_index": datasets.Value("int64"),
    })
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    datasets.disable_progress_bars()  # the report says what happened
    try:
        with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.") as work:
            dataset = _build(chat, config, report, features, Path(work) / "cache")
            report.note_unmatched_sources("--exclude-source", config.exclude_sources)
            report.note_unmatched_sources("--cap-source", [name for name, _ in config.source_caps])
            staging = Path(work) / "dataset"
            dataset.save_to_disk(str(staging))
            write_json_atomically(staging / METADATA_FILE, _metadata(tokenizer, config, report))
            publish(staging, out_dir, PREPARED)
    finally:
        datasets.enable_progress_bars()
    return report


def _build(chat: ChatTokenizer, config: PrepareConfig, report: DataReport, features: Any, cache_dir: Path) -> Any:
    """The tokenised rows as an Arrow-backed dataset, written incrementally under ``cache_dir``."""
    failure: list[ValueError] = []
    try:
        dataset = datasets.Dataset.from_generator(
            _generate, gen_kwargs={"chat": chat, "config": config, "report": report, "failure": failure},
            features=features, cache_dir=str(cache_dir),
        )
    except Exception:
        if report.kept and not failure:
            raise
        dataset = None  # datasets refuses an empty generator; a user error is raised below
    if failure:  # a user error inside the generator, which datasets would otherwise wrap
        raise failure[0]
    if dataset is None or report.kept == 0:
        raise ValueError(report.nothing_kept("rows", [spec.source for spec in config.sources]))
    return dataset


def _generate(
    chat: ChatTokenizer, config: PrepareConfig, report: DataReport, failure: list[ValueError]
) -> Iterator[dict[str, Any]]:
    try:
        yield from tokenized_rows(chat, config, report)
    except ValueError as error:
        failure.append(error)


def _same_settings(out_dir: Path, settings: dict[str, Any]) -> bool:
    """Whether ``out_dir`` holds a prepared dataset made with these settings (a re-run may replace it)."""
    found = json_object_or_none(out_dir / METADATA_FILE)
    return found is not None and all(found.get(key) == value for key, value in settings.items())


def _metadata(tokenizer: PreTrainedTokenizerBase, config: PrepareConfig, report: DataReport) -> dict[str, Any]:
    decontamination = project_eval_index().describe() if config.decontaminate else None
    return {**_settings(tokenizer, config), "counts": report.as_dict(), "decontamination": decontamination,
            **config.extra_metadata}


def _settings(tokenizer: PreTrainedTokenizerBase, config: PrepareConfig) -> dict[str, Any]:
    """What the dataset is made from: a folder holding another dataset is not replaced without --overwrite."""
    return {
        "format": "dflash-prepared-v1",
        "target": config.target_name,
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "chat_template_hash": template_hash(tokenizer),
        "thinking": config.thinking,
        "train_turns": config.train_turns,
        "max_length": config.max_length,
        "block_size": config.block_size,
        "min_supervised_tokens": config.min_supervised,
        "sources": [spec.source for spec in config.sources],
        **({"trim_loops": True} if config.trim_loops else {}),  # absent when off: earlier datasets still match
        **({"exclude_sources": sorted(config.exclude_sources)} if config.exclude_sources else {}),
        **({"source_caps": dict(sorted(config.source_caps))} if config.source_caps else {}),
        **({"keep_duplicates": True} if not config.dedupe else {}),
    }
