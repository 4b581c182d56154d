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

from dflash_train.atomic import replace_dir, staging_dir
from dflash_train.checkpoint.card import names_hub_model, render_card
from dflash_train.checkpoint.check import CARD_FILE, check_against_target, check_checkpoint
from dflash_train.checkpoint.hf_format import REMOTE_CODE_FILE, config_to_hf, merge_source_config
from dflash_train.checkpoint.io import read_checkpoint, write_draft_files
from dflash_train.checkpoint.weights import DEFAULT_MAX_SHARD_BYTES
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
        replace_dir(tmp, out_dir)
    return out_dir


def _refuse_destination(out_dir: Path, source: Path, overwrite: bool) -> None:
    if out_dir.resolve() == source.resolve():
        raise ValueError(f"--out {out_dir} is the source checkpoint itself; export to another directory")
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} exists and is not a directory; choose another --out")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ValueError(f"{out_dir} already exists and is not empty; pass --overwrite to replace it")


def _target_config(target: Any) -> Any:
    if target is None:
        return None
    if isinstance(target, (str, Path)):
        return load_target_config(str(target))
    # A TargetModel (has .model and .config) or a transformers config / config.json dict.
    return target.config if hasattr(target, "model") and hasattr(target, "config") else target
