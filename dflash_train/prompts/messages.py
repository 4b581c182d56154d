"""A corpus's records as chat messages: the usable ones, each with the source label its rows carry, and the
others counted by reason. Every stage that reads a corpus (``pack``, ``dflash-train regenerate``, ``prepare``)
reads it through here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dflash_train.prompts.corpora import Corpus, CorpusSpec
from dflash_train.prompts.records import BadRecord, detect_format, rename_columns, to_messages
from dflash_train.quality import DataReport


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


Label = tuple[str, int]  # the source name and index a record's rows are labelled with


def record_label(record: dict[str, Any], name: str, index: int) -> Label:
    """The source name and index a record's rows are labelled with: its own string ``source`` (with its own
    integer ``source_index``, else ``index``: a file of an earlier pack, or of ``self-prompt``, keeps its
    sources apart through a repack), else ``name`` (its corpus's) and ``index``. Only the label: messages
    about a record still name its file and line (``corpus.location``)."""
    source, own_index = record.get("source"), record.get("source_index")
    if not isinstance(source, str) or not source:
        return name, index
    # bool is an int subclass, and a JSON true is no index
    return source, own_index if isinstance(own_index, int) and not isinstance(own_index, bool) else index


def _detected_format(record: dict[str, Any], corpus: Corpus, index: int) -> str:
    """The format of the first usable record; the error names its line, which may be damaged."""
    try:
        return detect_format(list(record))
    except ValueError as error:
        raise ValueError(f"{corpus.location(index)}: {error}") from None
