"""Saving and loading drafters in the published layout (ours and z-lab's).

    save_draft(model, dir)        config.json + model.safetensors (bf16 by default), written atomically
    load_draft(dir_or_hub_id)     -> DFlashDraftModel; reads ours and the published z-lab layout

`load_draft` keeps the source `config.json` on `model.source_config`; `save_draft` carries over the
keys it does not generate itself (bos/eos ids and the like), so `save_draft(load_draft(x))`
reproduces `x`'s tensors bit for bit and its config keys.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_train.atomic import staging_dir, update_files
from dflash_train.checkpoint.hf_format import (
    config_from_hf,
    config_to_hf,
    expected_tensor_shapes,
    merge_source_config,
)
from dflash_train.checkpoint.hub import resolve_checkpoint_dir
from dflash_train.checkpoint.weights import (
    DEFAULT_MAX_SHARD_BYTES,
    INDEX_FILE,
    SINGLE_FILE,
    read_tensors,
    write_tensors,
)
from dflash_train.json_files import read_json_object
from dflash_train.models import DFlashConfig, DFlashDraftModel
from dflash_train.models.layers import RotaryEmbedding

CONFIG_FILE = "config.json"
# Runtimes that wrap the drafter (vLLM, SpecForge) store it under `model.`; we strip that on import.
TOLERATED_PREFIX = "model."
_SHARD_PATTERN = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


@dataclass
class DraftCheckpoint:
    directory: Path
    hf_config: dict[str, Any]  # config.json as stored
    config: DFlashConfig
    tensors: dict[str, torch.Tensor]  # export names, no prefix


def read_config_json(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{directory} has no {CONFIG_FILE}; point at a drafter checkpoint directory")
    return read_json_object(path, "fix or re-export it")


def read_checkpoint(path_or_hub_id: str | Path) -> DraftCheckpoint:
    """Config and tensors of a drafter checkpoint, tensor names normalised and checked against the config."""
    directory = resolve_checkpoint_dir(path_or_hub_id)
    hf_config = read_config_json(directory)
    try:
        config = config_from_hf(hf_config)
    except (TypeError, ValueError) as error:  # a value of the wrong type or range, e.g. a list where an int goes
        raise ValueError(f"{directory / CONFIG_FILE} does not describe a drafter ({error}); fix or re-export "
                         f"it") from error
    tensors = normalise_names(read_tensors(directory), expected_tensor_shapes(config), directory)
    return DraftCheckpoint(directory, hf_config, config, tensors)


def normalise_names(
    tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], source: Path
) -> dict[str, torch.Tensor]:
    """Strip a `model.` prefix, then require exactly the expected names and shapes."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        key = name.removeprefix(TOLERATED_PREFIX) if name not in expected else name
        if key in out:
            raise ValueError(f"{source} stores {key!r} twice (with and without the {TOLERATED_PREFIX!r} prefix)")
        out[key] = tensor
    missing = sorted(set(expected) - set(out))
    unexpected = sorted(set(out) - set(expected))
    if missing:
        raise ValueError(f"{source} lacks {len(missing)} drafter tensors, e.g. {missing[:3]}; "
                         f"its weights do not match its config.json")
    if unexpected:
        raise ValueError(f"{source} holds {len(unexpected)} unexpected tensors, e.g. {unexpected[:3]}; a DFlash "
                         f"drafter stores only fc, hidden_norm, layers.* and norm (the target owns embed/lm_head)")
    wrong = [f"{k} {tuple(out[k].shape)} != {v}" for k, v in expected.items() if tuple(out[k].shape) != v]
    if wrong:
        raise ValueError(f"{source} has tensors of the wrong shape for its config.json: {'; '.join(wrong[:3])}")
    return out


def load_draft(
    path_or_hub_id: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> DFlashDraftModel:
    """Load a drafter (our export or training checkpoint, or a published z-lab one; local or Hub id).

    `dtype=None` keeps the stored dtype (float32 if the file mixes dtypes).
    """
    return draft_from_checkpoint(read_checkpoint(path_or_hub_id), device=device, dtype=dtype)


def draft_from_checkpoint(
    checkpoint: DraftCheckpoint, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> DFlashDraftModel:
    """The drafter of a checkpoint already read (a command reads it before loading the target, so a bad path
    fails in a second, not after the target has loaded)."""
    dtype = dtype or _stored_dtype(checkpoint.tensors)
    # Built on the meta device: random initialisation of a Qwen3-8B-sized drafter would take seconds.
    with torch.device("meta"):
        model = DFlashDraftModel(checkpoint.config)
    state = {name: t.to(device=device, dtype=dtype) for name, t in checkpoint.tensors.items()}
    model.load_state_dict(state, strict=True, assign=True)
    # Non-persistent buffers are not in the file: rebuild RoPE for real, and keep it in fp32.
    model.rotary_emb = RotaryEmbedding(checkpoint.config).to(device)
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers())), "tensor left on meta device"
    model.source_config = checkpoint.hf_config
    return model.eval()


def _stored_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype:
    dtypes = {t.dtype for t in tensors.values()}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def save_draft(
    model: DFlashDraftModel,
    out_dir: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    extra_config: dict[str, Any] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write `config.json` and the weights (export names, `dtype`) to `out_dir`; returns `out_dir`.

    A new `out_dir` appears complete or not at all; in an existing one only our files are replaced
    (config.json last) and other files, such as optimizer state, are kept. `extra_config` adds keys
    to config.json (it may not override the generated ones).
    """
    out_dir = Path(out_dir)
    hf_config = build_config(model, dtype, extra_config)
    # torch.compile'd submodules name their weights `..._orig_mod.<name>`; the file must not.
    tensors = {name.replace("_orig_mod.", ""): t.detach().to(dtype) for name, t in model.state_dict().items()}
    normalise_names(tensors, expected_tensor_shapes(model.config), Path("<model>"))
    with staging_dir(out_dir) as tmp:
        write_draft_files(tmp, tensors, hf_config, max_shard_bytes)
        if out_dir.exists():
            update_files(tmp, out_dir, stale=_weight_names(out_dir), last=CONFIG_FILE)
        else:
            tmp.rename(out_dir)
    return out_dir


def write_draft_files(
    directory: Path, tensors: dict[str, torch.Tensor], hf_config: dict[str, Any], max_shard_bytes: int
) -> None:
    write_tensors(tensors, directory, max_shard_bytes)
    (directory / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")


def build_config(model: DFlashDraftModel, dtype: torch.dtype, extra: dict[str, Any] | None) -> dict[str, Any]:
    generated = config_to_hf(model.config, str(dtype).removeprefix("torch."))
    clash = sorted(set(extra or {}) & set(generated))
    if clash:
        raise ValueError(f"extra_config may not override generated config keys {clash}; change the DFlashConfig")
    source = {**(getattr(model, "source_config", None) or {}), **(extra or {})}
    return merge_source_config(generated, source)


def _weight_names(directory: Path) -> list[str]:
    names = [p.name for p in directory.iterdir() if _SHARD_PATTERN.fullmatch(p.name)]
    return names + [SINGLE_FILE, INDEX_FILE]


__all__ = ["DraftCheckpoint", "load_draft", "read_checkpoint", "save_draft"]
