"""A target's config without its weights, and the few facts from it that a drafter checkpoint must agree with."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from dflash_train.errors import first_line
from dflash_train.target.conversion import existing_conversion
from dflash_train.target.gguf_file import check_gguf_whole
from dflash_train.target.loading import resolve_target_source


@dataclass(frozen=True)
class TargetFacts:
    hidden_size: int
    vocab_size: int  # embedding rows
    num_layers: int
    max_position_embeddings: int | None


def target_facts(target_config: Any) -> TargetFacts:
    """From a transformers config (multimodal ones via their text config) or a config.json dict."""
    if isinstance(target_config, Mapping):
        values = dict(target_config.get("text_config") or target_config)
    else:
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        values = text.to_dict() if hasattr(text, "to_dict") else dict(vars(text))
        # properties (a hybrid config derives its layer count from its layer pattern) are not in to_dict()
        values.update({name: getattr(text, name) for name in FACT_NAMES if getattr(text, name, None) is not None})
    try:
        return TargetFacts(
            hidden_size=int(values["hidden_size"]),
            vocab_size=int(values["vocab_size"]),
            num_layers=int(values.get("num_hidden_layers") or _layers_from_pattern(values)),
            max_position_embeddings=values.get("max_position_embeddings"),
        )
    except KeyError as error:
        raise ValueError(f"the target config has no {error}; pass a causal LM's config") from error


FACT_NAMES = ("hidden_size", "vocab_size", "num_hidden_layers", "max_position_embeddings")
LAYER_PATTERNS = ("layers_block_type", "layer_types", "hybrid_override_pattern")  # one entry per decoder layer


def _layers_from_pattern(values: dict[str, Any]) -> int:
    """The layer count of a config.json that names its layers one by one instead (Nemotron-H's pattern)."""
    for name in LAYER_PATTERNS:
        if values.get(name):
            return len(values[name])
    raise KeyError("num_hidden_layers")


def load_target_config(name_or_path: str) -> Any:
    """A target's config from an alias, a local directory, a .gguf file or a Hub id (no weights loaded)."""
    source = resolve_target_source(name_or_path)
    if source.endswith(".gguf"):
        check_gguf_whole(Path(source))  # a truncated file would fail deep in the GGUF reader with a numpy error
    try:
        if source.endswith(".gguf"):
            path = Path(source)
            # A converted copy's config.json holds the same config; the GGUF's metadata holds the whole
            # vocabulary too, which transformers parses in seconds on every export and check.
            converted = existing_conversion(path)
            if converted is not None:
                return AutoConfig.from_pretrained(converted)
            return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        return AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as error:
        raise ValueError(f"Could not read the config of target {name_or_path!r} ({first_line(error)}); pass a "
                         f"local model directory, a .gguf file, an alias or a reachable Hub id") from error
