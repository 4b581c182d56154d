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


def check_launch(saved: dict[str, Any], distributed_type: str, num_processes: int, path: Path) -> None:
    """DeepSpeed keeps its state (optimizer shards per rank) in its own layout, which only DeepSpeed reads:
    a checkpoint crosses between DeepSpeed and DDP/FSDP/one process only through its drafter weights."""
    saved_type = saved.get("distributed_type")
    if saved_type is None or (saved_type == "DEEPSPEED") == (distributed_type == "DEEPSPEED"):
        return
    was = f"DeepSpeed on {saved.get('num_processes', '?')} processes" if saved_type == "DEEPSPEED" else \
        f"{saved_type} on {saved.get('num_processes', '?')} process(es)"
    now = "DeepSpeed" if distributed_type == "DEEPSPEED" else distributed_type
    raise ValueError(
        f"checkpoint {path} was written under {was} and this run uses {now}: resume it with the launch config "
        f"it was written with, or start a new run from its weights (model.init_from={path / 'draft'}, "
        "training.resume=none)")


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


class CheckpointSpaceError(ValueError):
    """The disk cannot take the next checkpoint (raised before writing it, or after a write that ran out)."""


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bytes_needed(output_dir: str | Path, first_estimate: int) -> int:
    """Room the next checkpoint needs: the newest one's size (they do not grow), else `first_estimate`.
    The previous checkpoints stay until the new one is complete, so nothing already saved is at risk."""
    found = list_checkpoints(output_dir)
    return directory_bytes(found[-1]) if found else first_estimate


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def space_error(output_dir: str | Path, step: int, needed: int) -> CheckpointSpaceError | None:
    """The one-line error for a checkpoint that does not fit the disk, or None when it fits."""
    root = checkpoint_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    free = free_bytes(root)
    if free >= needed * 1.05:
        return None
    found = list_checkpoints(output_dir)
    kept = f"the newest checkpoint {found[-1]} is intact and the same command resumes from it" if found else \
        "no checkpoint of this run is saved yet"
    return CheckpointSpaceError(
        f"disk full: checkpoint step-{step:08d} needs ~{needed / 2**30:.1f} GiB in {root}, {free / 2**30:.1f} GiB "
        f"free; free space, point training.output_dir at a larger disk or lower training.keep_last ({kept})")


def read_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((path / "trainer_state.json").read_text())
