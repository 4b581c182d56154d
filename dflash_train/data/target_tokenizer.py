"""The target's tokenizer without loading its weights (``prepare`` needs nothing else)."""

from __future__ import annotations

from pathlib import Path

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dflash_train.target import ensure_converted_gguf, load_tokenizer, resolve_target_source


def load_target_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """Tokenizer of an alias, Hub id, local directory or ``.gguf`` file (as ``load_target`` resolves them)."""
    source = resolve_target_source(name_or_path)
    if source.endswith(".gguf"):
        source = str(ensure_converted_gguf(Path(source)))
    return load_tokenizer(source, name_or_path)
