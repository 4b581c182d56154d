"""Training checkpoints: written atomically, the newest k kept, refused when they don't fit the run.

    <output_dir>/checkpoints/step-00001000/
        draft/                 drafter weights + config in the export format (tensor names of SPEC §4)
        state/                 accelerate state: model, optimizer, scheduler, RNG (sharded under DeepSpeed/FSDP)
        trainer_state.json     step, samples seen, and what the checkpoint is compatible with

A checkpoint exists only once its directory has its final name: a run killed while saving leaves a
`*.tmp` directory, which resume ignores and the next save removes.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

CHECKPOINT_PATTERN = re.compile(r"^step-(\d{8})$")
COMPAT_KEYS = ("target_fingerprint", "target_layer_ids", "block_size", "hidden_size", "vocab_size", "mask_token_id")


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if CHECKPOINT_PATTERN.match(p.name) and (p / "trainer_state.json").is_file()]
    return sorted(found, key=lambda p: p.name)


def resolve_resume(resume: str, output_dir: str | Path) -> Path | None:
    if resume == "none":
        return None
    if resume == "auto":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise ValueError(f"training.resume={resume}: no complete checkpoint there (trainer_state.json missing)")
    return path


def check_compatible(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    problems = [
        f"{key}: checkpoint has {saved.get(key)!r}, this run has {current[key]!r}"
        for key in COMPAT_KEYS
        if key in current and saved.get(key) != current[key]
    ]
    if problems:
        raise ValueError(
            f"checkpoint {path} belongs to another setup ({'; '.join(problems)}); "
            "use a new training.output_dir or training.resume=none"
        )


def staging_dir(output_dir: str | Path, step: int) -> tuple[Path, Path]:
    """(temporary directory to write into, final name)."""
    root = checkpoint_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step-{step:08d}"
    return root / f"{final.name}.tmp", final


def finalize(tmp: Path, final: Path, trainer_state: dict[str, Any], keep_last: int) -> None:
    """Write the marker file last, rename into place, then prune old checkpoints."""
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in list_checkpoints(final.parent.parent)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def read_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((path / "trainer_state.json").read_text())
