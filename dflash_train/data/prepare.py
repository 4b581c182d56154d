"""Corpora -> tokenised chats with loss masks, saved as a prepared dataset (see ``prepared.py``).

Rows are validated (``records.py``), rendered and masked with the target's chat template (``chat.py``),
cut to ``max_length`` keeping whole assistant spans where possible, and dropped when fewer than
``min_supervised`` (``2 * block_size``) tokens remain supervised. Rows whose prompt turns share a word
13-gram with an eval set are dropped as ``overlaps_eval_set`` (``decontaminate.py``; the metadata lists the
eval sets). Every drop is counted by reason, and a reason that drops more than 5 % of the rows gets a
warning line in the summary. A conversation whose template renders some turns differently once later turns
follow gives those turns rows of their own (``chat.py``).
``show`` prints rows with their supervised text marked, writing nothing.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import datasets
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dflash_train.atomic import write_json_atomically
from dflash_train.data.chat import ChatTokenizer, TokenizedChat, fit_length, marked_text, template_hash
from dflash_train.data.corpora import Corpus, CorpusSpec, open_corpus
from dflash_train.data.decontaminate import DROP_REASON as EVAL_OVERLAP
from dflash_train.data.decontaminate import project_eval_index
from dflash_train.data.prepared import METADATA_FILE, tokenizer_hash
from dflash_train.data.quality import DataReport
from dflash_train.data.records import BadRecord, detect_format, rename_columns, to_messages
from dflash_train.data.shards import REGEN_MANIFEST
from dflash_train.outputs import PREPARED, claim, publish


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
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("chat_template_hash") != template_hash(tokenizer):
            raise ValueError(f"{manifest_path}: responses generated with another chat template than this target's; "
                             f"prepare them with the target that generated them")
        if thinking is None:
            thinking = manifest.get("thinking")
        elif manifest.get("thinking") is not None and manifest["thinking"] != thinking:
            raise ValueError(f"{manifest_path}: generated with thinking {'on' if manifest['thinking'] else 'off'}; "
                             f"prepare with the same --thinking")
    return thinking


def iter_messages(
    corpus: Corpus, spec: CorpusSpec, report: DataReport, prompt_only: bool = False
) -> Iterator[tuple[int, dict[str, Any], list]]:
    """(index, record, messages) for every usable record; the others are counted in ``report``."""
    fmt = None if spec.fmt == "auto" else spec.fmt
    if corpus.truncated:
        report.dropped["truncated_file_tail"] += corpus.truncated
    for index, record in enumerate(corpus):
        report.read += 1
        try:
            if isinstance(record, BadRecord):
                raise record
            record = rename_columns(record, spec.column_map)
            fmt = fmt or _detected_format(record, corpus, index)
            yield index, record, to_messages(record, fmt, prompt_only)
        except BadRecord as bad:
            report.drop(bad.reason, corpus.location(index))


def _detected_format(record: dict[str, Any], corpus: Corpus, index: int) -> str:
    """The format of the first usable record; the error names its line, which may be damaged."""
    try:
        return detect_format(list(record))
    except ValueError as error:
        raise ValueError(f"{corpus.location(index)}: {error}") from None


def tokenized_rows(chat: ChatTokenizer, config: PrepareConfig, report: DataReport) -> Iterator[dict[str, Any]]:
    evals = project_eval_index() if config.decontaminate else None
    for spec in config.sources:
        corpus = open_corpus(spec)
        for index, record, messages in iter_messages(corpus, spec, report):
            if evals is not None and evals.overlaps(messages):
                report.drop(EVAL_OVERLAP, corpus.location(index))
                continue
            try:
                conversation = chat.tokenize(messages, config.train_turns, record.get("finish_reason") == "length")
            except BadRecord as bad:
                report.drop(bad.reason, corpus.location(index))
                continue
            report.totals["turns not reproducible by the template"] += conversation.turns_not_reproducible
            samples = [fit_length(sample, config.max_length) for sample in conversation.samples]
            kept = [sample for sample in samples if sample.num_supervised >= config.min_supervised]
            if not kept:
                too_long = any(sample.truncated for sample in samples)
                report.drop("too_long" if too_long else "too_few_supervised_tokens", corpus.location(index))
                continue
            report.kept += 1
            if len(kept) < len(samples):  # a turn in a row of its own (see chat.py) can be short alone
                report.totals["rows of single turns dropped as too short"] += len(samples) - len(kept)
            for sample in kept:
                yield _row(sample, corpus.name, index, report)


def _row(sample: TokenizedChat, source: str, index: int, report: DataReport) -> dict[str, Any]:
    report.totals["rows written"] += 1  # more than the rows kept when turns get rows of their own
    report.totals["rows truncated"] += sample.truncated
    report.totals["tokens"] += len(sample.input_ids)
    report.totals["supervised tokens"] += sample.num_supervised
    return {
        "input_ids": sample.input_ids,
        "loss_mask": sample.loss_mask,
        "num_supervised": sample.num_supervised,
        "source": source,
        "source_index": index,
    }


def show(tokenizer: PreTrainedTokenizerBase, config: PrepareConfig, count: int) -> DataReport:
    """Print the first ``count`` rows as ``prepare`` would write them, the supervised text between ⟦ ⟧, so a
    new target's template and masks can be checked by eye; nothing is written. Returns the report of the rows
    read for them."""
    config.thinking = settings_of_regenerated(config.sources, tokenizer, config.thinking)
    chat = ChatTokenizer(tokenizer, config.thinking, config.target_name)
    report = DataReport(f"prepare --show {count} (nothing written): the rows read for them")
    print("⟦...⟧ marks the supervised tokens (the loss mask)")
    for number, row in enumerate(islice(tokenized_rows(chat, config, report), count), 1):
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
        raise ValueError(f"no usable rows in {[s.source for s in config.sources]}: {report.as_dict()['dropped']}")
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
    try:
        found = json.loads((out_dir / METADATA_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(found, dict) and all(found.get(key) == value for key, value in settings.items())


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
    }
