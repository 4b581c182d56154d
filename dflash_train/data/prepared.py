"""The prepared-dataset format shared by every step after ``prepare``.

A directory written by ``datasets.Dataset.save_to_disk`` with columns ``input_ids`` (list of int) and
``loss_mask`` (list of 0/1, same length) plus metadata columns, and ``dflash_data.json`` in it recording the
tokenizer, chat-template hash, thinking setting, max length and counts.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import datasets
import pyarrow.compute as pc
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dflash_train.json_files import read_json_object

METADATA_FILE = "dflash_data.json"
REQUIRED_COLUMNS = ("input_ids", "loss_mask")


def tokenizer_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """Identifies a vocabulary: two tokenizers with the same hash map text to the same ids."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:16]


def read_metadata(path: str | Path) -> dict[str, Any]:
    meta = Path(path) / METADATA_FILE
    if not meta.is_file():
        raise ValueError(f"{path} is not a prepared dataset ({METADATA_FILE} missing); run `dflash-train prepare`")
    return read_json_object(meta, "run `dflash-train prepare` again")


def load_prepared(path: str | Path) -> Any:
    """The ``datasets.Dataset`` of a prepared directory, checked for the two required columns."""
    read_metadata(path)
    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as error:  # datasets raises many types for damaged files (a KeyError for a bad state.json)
        raise ValueError(f"{path}: cannot read the prepared dataset ({_one_line(error)}); run `dflash-train prepare` "
                         f"again") from error
    missing = [column for column in REQUIRED_COLUMNS if column not in dataset.column_names]
    if missing:
        raise ValueError(f"{path}: columns {missing} missing; run `dflash-train prepare` again")
    return dataset


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def check_tokenizer(path: str | Path, tokenizer: PreTrainedTokenizerBase, target_name: str) -> dict[str, Any]:
    """Refuse data tokenised with another vocabulary than the target's."""
    meta = read_metadata(path)
    if meta.get("tokenizer_hash") != tokenizer_hash(tokenizer):
        raise ValueError(
            f"{Path(path) / METADATA_FILE}: tokenised for {meta.get('target')!r}, whose vocabulary differs from "
            f"{target_name!r}'s; run `dflash-train prepare --target {target_name}` on the data again"
        )
    check_rows(path, max(tokenizer.get_vocab().values()) + 1)
    return meta


def check_rows(path: str | Path, vocab_size: int) -> None:
    """Refuse rows that `prepare` cannot have written: ids the tokenizer cannot produce, a loss mask not of
    0/1 or not as long as its row. Arrow files carry no checksum, so a damaged one still loads, and its ids
    would end in an index error inside the target's embedding, far from the cause."""
    table = load_prepared(path).data
    ids, mask = table.column("input_ids"), table.column("loss_mask")
    problem = None
    if ids.null_count or mask.null_count:
        problem = "rows without token ids or loss mask"
    elif pc.all(pc.equal(pc.list_value_length(ids), pc.list_value_length(mask))).as_py() is False:  # None: no rows
        problem = "a loss mask is not as long as its row"
    elif not _within(mask, 0, 1):
        problem = "loss masks hold values other than 0 and 1"
    elif not _within(ids, 0, vocab_size - 1):
        problem = f"token ids outside the tokenizer's {vocab_size}"
    if problem is not None:
        raise ValueError(f"{path}: {problem}, so its data files are damaged; run `dflash-train prepare` again")


def _within(column: Any, low: int, high: int) -> bool:
    values = pc.list_flatten(column)
    if values.null_count:
        return False
    bounds = pc.min_max(values)
    found_low, found_high = bounds["min"].as_py(), bounds["max"].as_py()
    return found_low is None or (low <= found_low and found_high <= high)  # None: no tokens at all
