"""The frozen target LLM (docs/design.md §2): finding and loading it, reading its decoder-layer outputs,
and the facts about it that drafters, feature stores and checkpoints are checked against.

    loading       alias, local directory, .gguf file or Hub id -> `TargetModel`
    conversion    the cache of GGUF files converted once to safetensors
    gguf_file     just enough GGUF parsing to refuse a truncated file and key its conversion
    model         `TargetModel`: the frozen model, its tokenizer and its feature captures
    capture       forward hooks that record layer outputs; forwards over unpacked rows
    layer_ids     default spread and validation of target layer ids
    mask_token    the mask token's resolution order
    config        a target's config without its weights, and the facts a drafter must agree with
    fingerprint   the hash that feature stores and checkpoints record of their target
"""

from dflash_train.target.capture import rows_not_packed
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
from dflash_train.target.layer_ids import (
    default_target_layer_ids,
    validate_drafter_layer_ids,
    validate_target_layer_ids,
)
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
    "default_target_layer_ids",
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
    "rows_not_packed",
    "target_facts",
    "target_fingerprint",
    "target_identity",
    "validate_drafter_layer_ids",
    "validate_target_layer_ids",
]
