"""The frozen target LLM (docs/design.md §2): finding and loading it, and the facts about it that drafters,
feature stores and checkpoints are checked against. Reading its decoder-layer outputs (and which layers) is
`dflash_train.features`'s: nothing here imports it.

    loading       alias, local directory, .gguf file or Hub id -> `TargetModel`
    conversion    the cache of GGUF files converted once to safetensors
    gguf_file     just enough GGUF parsing to refuse a truncated file and key its conversion
    model         `TargetModel`: the frozen model, its tokenizer and its decoder layers
    attention     the Hugging Face attention a forward uses, switched for a `with` block
    mask_token    the mask token's resolution order
    config        a target's config without its weights, and the facts a drafter must agree with
    fingerprint   the hash that feature stores and checkpoints record of their target
"""

from dflash_train.target.config import TargetFacts, load_target_config, target_facts
from dflash_train.target.conversion import (
    CONVERSION_MARKER,
    converted_gguf_dir,
    default_targets_cache_dir,
    ensure_converted_gguf,
    load_gguf,
)
from dflash_train.target.fingerprint import (
    TargetIdentity,
    is_legacy_fingerprint,
    legacy_target_fingerprint,
    target_fingerprint,
    target_identity,
)
from dflash_train.target.gguf_file import check_gguf_whole, content_digest
from dflash_train.target.loading import (
    DEFAULT_TARGET_ALIASES,
    PackagedFile,
    load_target,
    load_tokenizer,
    resolve_target_source,
)
from dflash_train.target.mask_token import MaskTokenChoice, choose_mask_token, resolve_mask_token_id
from dflash_train.target.model import DECODER_LAYER_PATHS, TargetModel, find_decoder_layers

__all__ = [
    "CONVERSION_MARKER",
    "DECODER_LAYER_PATHS",
    "DEFAULT_TARGET_ALIASES",
    "MaskTokenChoice",
    "PackagedFile",
    "TargetFacts",
    "TargetIdentity",
    "TargetModel",
    "check_gguf_whole",
    "choose_mask_token",
    "content_digest",
    "converted_gguf_dir",
    "default_targets_cache_dir",
    "ensure_converted_gguf",
    "find_decoder_layers",
    "is_legacy_fingerprint",
    "legacy_target_fingerprint",
    "load_gguf",
    "load_target",
    "load_target_config",
    "load_tokenizer",
    "resolve_mask_token_id",
    "resolve_target_source",
    "target_facts",
    "target_fingerprint",
    "target_identity",
]
