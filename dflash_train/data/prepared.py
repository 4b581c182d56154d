"""The prepared-dataset format shared by every step after ``prepare``.

A directory written by ``datasets.Dataset.save_to_disk`` with columns ``input_ids`` (list of int) and
``loss_mask`` (list of 0/1, same length) plus metadata columns, and ``dflash_data.json`` in it recording the
tokenizer, chat-template hash, thinking setting, max length and counts.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

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
    try:
        return json.loads(meta.read_text())
    except ValueError as error:
        raise ValueError(f"{meta} is not valid JSON ({error}); run `dflash-train prepare` again") from error


def load_prepared(path: str | Path) -> Any:
    """The ``datasets.Dataset`` of a prepared directory, checked for the two required columns."""
    import datasets

    read_metadata(path)
    try:
        dataset = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as error:
        raise ValueError(f"{path}: cannot read the prepared dataset ({error}); run `dflash-train prepare` again") from error
    missing = [column for column in REQUIRED_COLUMNS if column not in dataset.column_names]
    if missing:
        raise ValueError(f"{path}: columns {missing} missing; run `dflash-train prepare` again")
    return dataset


def check_tokenizer(path: str | Path, tokenizer: PreTrainedTokenizerBase, target_name: str) -> dict[str, Any]:
    """Refuse data tokenised with another vocabulary than the target's."""
    meta = read_metadata(path)
    if meta.get("tokenizer_hash") != tokenizer_hash(tokenizer):
        raise ValueError(
            f"{Path(path) / METADATA_FILE}: tokenised for {meta.get('target')!r}, whose vocabulary differs from "
            f"{target_name!r}'s; run `dflash-train prepare --target {target_name}` on the data again"
        )
    return meta
