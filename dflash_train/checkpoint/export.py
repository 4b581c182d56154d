"""Export a drafter checkpoint as the directory every runtime loads as is (docs/design.md §9).

    export_checkpoint("runs/qwen3-8b/checkpoints/step-00020000", "exports/Qwen3-8B-DFlash-b16",
                      target="Qwen/Qwen3-8B")

Writes, into a staging directory first: config.json, bf16 model.safetensors (sharded with an index
above the shard size), dflash.py (the remote code shipped in `export/`), and README.md (the model
card). Then runs `check_checkpoint` on the result and only publishes a directory that passes.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from dflash_train.atomic import staging_dir
from dflash_train.checkpoint.card import names_hub_model, render_card
from dflash_train.checkpoint.check import CARD_FILE, check_against_target, check_checkpoint
from dflash_train.checkpoint.hf_format import REMOTE_CODE_FILE, config_to_hf, merge_source_config
from dflash_train.checkpoint.io import read_checkpoint, write_draft_files
from dflash_train.checkpoint.weights import DEFAULT_MAX_SHARD_BYTES
from dflash_train.outputs import EXPORTED, entries, holds_output, publish, refuse_inputs_inside
from dflash_train.target import load_target_config

CARD_TEMPLATE = "model_card.md"


def export_assets_dir() -> Path:
    """The `export/` folder (files shipped inside every export): in the source tree, or where a wheel
    installs it (`<prefix>/share/dflash-train/export`)."""
    candidates = [Path(__file__).resolve().parents[2] / "export",
                  Path(sys.prefix) / "share" / "dflash-train" / "export"]
    for assets in candidates:
        if (assets / REMOTE_CODE_FILE).is_file() and (assets / CARD_TEMPLATE).is_file():
            return assets
    raise ValueError(f"{REMOTE_CODE_FILE} and {CARD_TEMPLATE} not found in {' or '.join(map(str, candidates))}; "
                     f"install dflash-train from a source checkout with `pip install -e .`")


def export_checkpoint(
    src: str | Path,
    out_dir: str | Path,
    *,
    target: Any = None,
    card_info: dict[str, Any] | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Export `src` (our checkpoint, a z-lab one, or a Hub id) to `out_dir`; returns `out_dir`.

    `target`: the target's name/path (alias, directory, .gguf, Hub id) or its transformers config,
    to check the drafter against and to name as the card's `base_model`.
    """
    out_dir = Path(out_dir)
    checkpoint = read_checkpoint(src)
    _refuse_destination(out_dir, checkpoint.directory, overwrite)
    target_config = _target_config(target)
    hf_config = merge_source_config(config_to_hf(checkpoint.config, "bfloat16"), checkpoint.hf_config)
    if target_config is not None:
        mismatch = check_against_target(hf_config, target_config)
        if mismatch:
            raise ValueError(f"{src} does not fit target {target}: {'; '.join(mismatch)}")
    if names_hub_model(target):
        card_info = {"base_model": target, **(card_info or {})}
    tensors = {name: t.to(torch.bfloat16) for name, t in checkpoint.tensors.items()}
    assets = export_assets_dir()
    with staging_dir(out_dir) as tmp:
        write_draft_files(tmp, tensors, hf_config, max_shard_bytes)
        shutil.copyfile(assets / REMOTE_CODE_FILE, tmp / REMOTE_CODE_FILE)
        num_parameters = sum(t.numel() for t in tensors.values())
        card = render_card((assets / CARD_TEMPLATE).read_text(), checkpoint.config, num_parameters, card_info,
                           checkpoint.hf_config)
        (tmp / CARD_FILE).write_text(card)
        problems = check_checkpoint(tmp, target_config)
        if problems:
            raise ValueError(f"the export of {src} fails its own check: {'; '.join(problems)}")
        publish(tmp, out_dir, EXPORTED)  # only an earlier export's files are replaced; others stay
    return out_dir


def _refuse_destination(out_dir: Path, source: Path, overwrite: bool) -> None:
    """Refused: a folder that is or holds the source; a non-empty folder without `overwrite`; and, with it,
    a folder holding files of an export's names that no export wrote. The export replaces only an earlier
    export's own files and writes beside anything else, never replacing a folder as a whole."""
    refuse_inputs_inside(out_dir, [source])
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} exists and is not a directory; choose another --out")
    if not entries(out_dir):
        return
    earlier = holds_output(out_dir, EXPORTED)
    if not overwrite:
        what = "holds an earlier export" if earlier else "is not empty"
        raise ValueError(f"{out_dir} {what}; pass --overwrite to replace an earlier export's files (others stay)")
    clashing = [path.name for path in entries(out_dir) if EXPORTED.owns(path.name)]
    if clashing and not earlier:
        raise ValueError(f"{out_dir} holds {', '.join(clashing)} that no export wrote; choose another --out")


def _target_config(target: Any) -> Any:
    if target is None:
        return None
    if isinstance(target, (str, Path)):
        return load_target_config(str(target))
    # A TargetModel (has .model and .config) or a transformers config / config.json dict.
    return target.config if hasattr(target, "model") and hasattr(target, "config") else target
