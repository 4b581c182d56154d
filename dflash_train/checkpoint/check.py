"""Validate a drafter directory (ours or anyone's) against the export contract of docs/design.md §9.

Every runtime fails silently on a bad drafter (SGLang loads missing or misnamed tensors as random
weights, vLLM defaults a missing rope_theta to 1e6, a wrong mask or layer id only lowers
acceptance), so this reads the files themselves: required files and keys, tensor names, shapes
against the config, one dtype, ids in range, and, given the target's config, agreement with it.
`check_checkpoint` returns one line per problem; an empty list means the directory is fine.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from dflash_train.checkpoint.hf_format import (
    ARCHITECTURE,
    AUTO_MAP,
    FORBIDDEN_KEYS,
    REMOTE_CODE_FILE,
    tensor_shapes,
)
from dflash_train.checkpoint.io import CONFIG_FILE, TOLERATED_PREFIX, read_config_json
from dflash_train.checkpoint.weights import TensorInfo, read_tensor_infos, weight_files
from dflash_train.features.layer_ids import deepest_drafter_layer
from dflash_train.safetensors_io import DamagedFileError
from dflash_train.target import target_facts

CARD_FILE = "README.md"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json")
REQUIRED_INT_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "vocab_size", "max_position_embeddings", "block_size", "num_target_layers")
EXPECTED_VALUES: dict[str, Any] = {
    "architectures": [ARCHITECTURE],
    "auto_map": AUTO_MAP,
    "model_type": "qwen3",
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def check_checkpoint(directory: str | Path, target_config: Any = None) -> list[str]:
    """Problems found in `directory` (empty = OK). `target_config`: the target's transformers config
    or config.json dict, to check hidden size, vocabulary, layer count and max positions against."""
    directory = Path(directory)
    if not directory.is_dir():
        return [f"{directory} is not a directory"]
    problems = check_files(directory)
    try:
        hf = read_config_json(directory)
    except ValueError as error:
        return problems + [str(error)] if (directory / CONFIG_FILE).exists() else problems
    problems += check_config(hf)
    problems += check_tensors(directory, hf)
    if target_config is not None:
        problems += check_against_target(hf, target_config)
    return problems


def check_files(directory: Path) -> list[str]:
    problems = []
    if not (directory / CONFIG_FILE).is_file():
        problems.append(f"missing {CONFIG_FILE}")
    try:
        has_weights = weight_files(directory) is not None
    except ValueError as error:  # a corrupt index: reported here, so the other checks still run
        problems.append(str(error))
        has_weights = True
    if not has_weights:
        problems.append("missing model.safetensors (or model.safetensors.index.json with its shards)")
    if not (directory / REMOTE_CODE_FILE).is_file():
        problems.append(f"missing {REMOTE_CODE_FILE}: Transformers cannot load the drafter with trust_remote_code "
                        f"(dflash-train export adds it)")
    if not (directory / CARD_FILE).is_file():
        problems.append(f"missing {CARD_FILE} (the model card; dflash-train export writes it)")
    shipped = [name for name in TOKENIZER_FILES if (directory / name).exists()]
    if shipped:
        problems.append(f"ships tokenizer files {shipped}: the drafter uses the target's tokenizer; remove them")
    return problems


def check_config(hf: dict[str, Any]) -> list[str]:
    problems = [f"config.json {key} is {hf.get(key)!r}, expected {value!r}"
                for key, value in EXPECTED_VALUES.items() if hf.get(key) != value]
    problems += [f"config.json lacks integer {key}" for key in REQUIRED_INT_KEYS if not _is_int(hf.get(key))]
    for key in ("attention_bias", "rms_norm_eps", "layer_types"):
        if key not in hf:
            problems.append(f"config.json lacks {key}")
    if "torch_dtype" not in hf and "dtype" not in hf:  # transformers < 4.56 reads the first, >= 4.56 the second
        problems.append("config.json lacks torch_dtype (and dtype); add \"torch_dtype\": \"bfloat16\"")
    problems += [f"config.json has {key}: vLLM reads it before dflash_config.target_layer_ids and does not "
                 f"shift it; remove it" for key in FORBIDDEN_KEYS if key in hf]
    problems += _check_rope(hf) + _check_layer_types(hf) + _check_dflash_config(hf)
    return problems


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_rope(hf: dict[str, Any]) -> list[str]:
    if not isinstance(hf.get("rope_theta"), (int, float)):
        return ["config.json lacks a top-level rope_theta (vLLM would silently use 1e6); add the target's"]
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params and float(params["rope_theta"]) != float(hf["rope_theta"]):
        return [f"rope_theta {hf['rope_theta']} disagrees with rope_parameters.rope_theta {params['rope_theta']}"]
    return []


def _check_layer_types(hf: dict[str, Any]) -> list[str]:
    types, layers = hf.get("layer_types"), hf.get("num_hidden_layers")
    if not isinstance(types, list) or not _is_int(layers):
        return []
    if len(types) != layers:
        return [f"layer_types has {len(types)} entries for {layers} layers"]
    if any(t != "full_attention" for t in types):
        return [f"layer_types {types}: DFlash drafter layers use full_attention"]
    return []


def _check_dflash_config(hf: dict[str, Any]) -> list[str]:
    dflash = hf.get("dflash_config")
    if not isinstance(dflash, dict):
        return ["config.json lacks dflash_config {mask_token_id, target_layer_ids, block_size}"]
    problems = [f"dflash_config lacks {key}" for key in ("mask_token_id", "target_layer_ids", "block_size")
                if key not in dflash]
    if "block_size" in dflash and "block_size" in hf and dflash["block_size"] != hf["block_size"]:
        problems.append(f"dflash_config.block_size {dflash['block_size']} != top-level block_size {hf['block_size']}")
    if _is_int(hf.get("block_size")) and hf["block_size"] < 1:
        problems.append(f"block_size {hf['block_size']} must be at least 1")
    mask, vocab = dflash.get("mask_token_id"), hf.get("vocab_size")
    if "mask_token_id" in dflash and (not _is_int(mask) or (_is_int(vocab) and not 0 <= mask < vocab)):
        problems.append(f"mask_token_id {mask!r} is outside the vocabulary [0, {vocab}); use a row of the "
                        f"target's embedding")
    ids = dflash.get("target_layer_ids")
    if "target_layer_ids" in dflash:
        problems += _check_layer_ids(ids, hf.get("num_target_layers"))
    return problems


def _check_layer_ids(ids: Any, num_layers: Any) -> list[str]:
    if not isinstance(ids, list) or not ids or not all(_is_int(i) for i in ids):
        return [f"target_layer_ids {ids!r} must be a non-empty list of integers"]
    problems = []
    if ids != sorted(set(ids)):
        problems.append(f"target_layer_ids {ids} must be strictly increasing")
    if _is_int(num_layers):
        problems += _check_ids_in_range(ids, num_layers, "num_target_layers")
    return problems


def _check_ids_in_range(ids: list[int], num_layers: int, owner: str) -> list[str]:
    deepest = deepest_drafter_layer(num_layers)  # the last layer's output is never read (validate_drafter_layer_ids)
    out_of_range = [i for i in ids if not 0 <= i <= deepest]
    if not out_of_range:
        return []
    return [f"target_layer_ids {out_of_range} out of range for {owner} = {num_layers} layers: use ids in "
            f"0..{deepest}"]


def check_tensors(directory: Path, hf: dict[str, Any]) -> list[str]:
    try:
        infos = read_tensor_infos(directory)
    except DamagedFileError as error:
        return [str(error)]
    except (ValueError, OSError) as error:
        return [] if _reported_by_check_files(directory) else [f"cannot read the weights: {error}"]
    expected = _expected_shapes(hf)
    problems = _check_dtypes(infos, hf)
    if expected is None:
        return problems + ["cannot derive tensor shapes from config.json (see the missing keys above)"]
    problems += _check_names(infos, expected)
    problems += [f"tensor {name} has shape {list(infos[name].shape)}, config.json implies {list(shape)}"
                 for name, shape in expected.items() if name in infos and infos[name].shape != shape]
    return problems


def _reported_by_check_files(directory: Path) -> bool:
    """Whether the weights are missing or their index is corrupt (check_files said so already)."""
    try:
        return weight_files(directory) is None
    except ValueError:
        return True


def _expected_shapes(hf: dict[str, Any]) -> dict[str, tuple[int, ...]] | None:
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size")
    if not all(_is_int(hf.get(key)) for key in keys):
        return None
    ids = (hf.get("dflash_config") or {}).get("target_layer_ids") if isinstance(hf.get("dflash_config"), dict) else None
    if not isinstance(ids, list) or not ids:
        return None
    return tensor_shapes(
        hidden=hf["hidden_size"], layers=hf["num_hidden_layers"], heads=hf["num_attention_heads"],
        kv_heads=hf["num_key_value_heads"], head_dim=hf["head_dim"], intermediate=hf["intermediate_size"],
        num_features=len(ids), attention_bias=bool(hf.get("attention_bias", False)),
    )


def _check_names(infos: dict[str, TensorInfo], expected: dict[str, tuple[int, ...]]) -> list[str]:
    stored = set(infos)
    prefixed = sorted(n for n in stored - set(expected) if n.removeprefix(TOLERATED_PREFIX) in expected)
    missing = sorted(set(expected) - stored - {n.removeprefix(TOLERATED_PREFIX) for n in prefixed})
    owned_by_target = sorted(n for n in stored if "embed_tokens" in n or "lm_head" in n)
    other = sorted(stored - set(expected) - set(prefixed) - set(owned_by_target))
    problems = []
    if prefixed:
        problems.append(f"{len(prefixed)} tensors carry a 'model.' prefix (e.g. {prefixed[0]}): vLLM adds it "
                        f"itself and SGLang would load random weights; strip it (dflash-train export does)")
    if missing:
        problems.append(f"{len(missing)} tensors missing (e.g. {', '.join(missing[:3])}): runtimes would run "
                        f"them as random weights")
    if owned_by_target:
        problems.append(f"ships {owned_by_target}: the drafter uses the target's embedding and lm_head; remove them")
    if other:
        problems.append(f"{len(other)} unexpected tensors (e.g. {', '.join(other[:3])}) for this config.json")
    return problems


def _check_dtypes(infos: dict[str, TensorInfo], hf: dict[str, Any]) -> list[str]:
    counts = Counter(info.dtype for info in infos.values())
    if len(counts) > 1:
        minority = min(counts, key=lambda d: counts[d])
        example = next(name for name, info in sorted(infos.items()) if info.dtype == minority)
        listing = ", ".join(f"{d} x{n}" for d, n in counts.most_common())
        return [f"mixed tensor dtypes ({listing}, e.g. {example} is {minority}); store every tensor as bfloat16"]
    if not counts:
        return ["the weight files hold no tensors"]
    stored = SAFETENSORS_DTYPES.get(next(iter(counts)), next(iter(counts)))
    problems = []
    if stored != "bfloat16":
        problems.append(f"tensors are {stored}; the export contract is bfloat16 (dflash-train export converts)")
    for key in ("torch_dtype", "dtype"):
        if key in hf and hf[key] != stored:
            problems.append(f"config.json {key} {hf[key]!r} disagrees with the stored tensors ({stored})")
    return problems


def check_against_target(hf: dict[str, Any], target_config: Any) -> list[str]:
    facts = target_facts(target_config)
    problems = []
    for key, value in (("hidden_size", facts.hidden_size), ("vocab_size", facts.vocab_size),
                       ("num_target_layers", facts.num_layers)):
        if hf.get(key) != value:
            problems.append(f"config.json {key} {hf.get(key)} != the target's {value}")
    dflash = hf.get("dflash_config") if isinstance(hf.get("dflash_config"), dict) else {}
    ids = dflash.get("target_layer_ids")
    if isinstance(ids, list) and all(_is_int(i) for i in ids):
        problems += _check_ids_in_range(ids, facts.num_layers, "the target")
    mask = dflash.get("mask_token_id")
    if _is_int(mask) and not 0 <= mask < facts.vocab_size:
        problems.append(f"mask_token_id {mask} is outside the target's vocabulary [0, {facts.vocab_size})")
    positions, ours = facts.max_position_embeddings, hf.get("max_position_embeddings")
    if _is_int(positions) and _is_int(ours) and ours < positions:
        problems.append(f"max_position_embeddings {ours} < the target's {positions}; use at least the target's")
    return problems
