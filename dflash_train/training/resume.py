"""Training checkpoints: written atomically, the newest k kept, refused when they don't fit the run.

    <output_dir>/checkpoints/step-00001000/
        draft/                 drafter weights + config in the export format (docs/design.md §9)
        state/                 accelerate state: model, optimizer, scheduler, RNG (sharded under DeepSpeed/FSDP)
        trainer_state.json     step, samples seen, and what the checkpoint is compatible with

A checkpoint exists only once its directory has its final name: a run killed while saving leaves a
`*.tmp` directory, which resume ignores and the next save removes. A checkpoint damaged later (a
truncated copy, a disk error) is found before resuming: `resume: auto` falls back to the newest whole
one, and saving never prunes a checkpoint newer than the one it writes, so the damaged one stays on
disk until a new save of that step replaces it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_train.safetensors_io import safetensors_damage
from dflash_train.target import is_legacy_fingerprint
from dflash_train.training.run_files import checkpoint_root, list_checkpoints

COMPAT_KEYS = ("target_fingerprint", "target_layer_ids", "block_size", "hidden_size", "vocab_size", "mask_token_id")


def _say_on_rank_zero(message: str) -> None:
    # Every rank resolves the same checkpoint; one of them says so.
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)


def resolve_resume(
    resume: str, output_dir: str | Path, say: Callable[[str], None] = _say_on_rank_zero
) -> Path | None:
    """The checkpoint to resume from: None (`none`, or `auto` without checkpoints), the newest whole one
    (`auto`, saying which damaged ones it passed over), or the given path, refused if damaged."""
    if resume == "none":
        return None
    if resume == "auto":
        return newest_whole_checkpoint(output_dir, say)
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise ValueError(f"training.resume={resume}: no complete checkpoint there (trainer_state.json missing)")
    damage = checkpoint_damage(path)
    if damage is not None:
        raise ValueError(f"training.resume={resume}: the checkpoint is damaged ({damage}); resume from an earlier "
                         f"checkpoint, or set training.resume=auto to take the newest whole one")
    return path


def newest_whole_checkpoint(output_dir: str | Path, say: Callable[[str], None]) -> Path | None:
    skipped: list[str] = []
    for path in reversed(list_checkpoints(output_dir)):
        damage = checkpoint_damage(path)
        if damage is None:
            if skipped:
                say(f"training.resume=auto: skipping damaged checkpoint {'; '.join(skipped)}; resuming from "
                    f"{path.name} (the damaged one is left on disk until training saves that step again)")
            return path
        skipped.append(f"{path.name} ({damage})")
    if skipped:
        raise ValueError(f"every checkpoint in {checkpoint_root(output_dir)} is damaged ({'; '.join(skipped)}); "
                         f"copy a whole one back, or start over with training.resume=none")
    return None


def checkpoint_damage(path: Path) -> str | None:
    """What makes the checkpoint at `path` unreadable (a truncated or corrupt file), or None.

    Cheap: safetensors headers against file sizes, and the zip directory of torch.save files (at their
    end, so a truncated file loses it); tensor data itself is not read.
    """
    try:
        json.loads((path / "trainer_state.json").read_text())
    except (OSError, ValueError) as error:
        return f"trainer_state.json unreadable: {error}"
    for file in sorted(path.rglob("*")):
        if not file.is_file():
            continue
        damage = _file_damage(file)
        if damage is not None:
            return f"{file.relative_to(path)}: {damage}"
    return None


def _file_damage(file: Path) -> str | None:
    if file.suffix == ".safetensors":
        return safetensors_damage(file)
    if file.suffix in (".bin", ".pt", ".pth") and _starts_like_zip(file):
        try:
            with zipfile.ZipFile(file):
                return None
        except (zipfile.BadZipFile, OSError):
            return f"truncated or corrupt ({file.stat().st_size:,} bytes, no readable zip directory)"
    return None


def _starts_like_zip(file: Path) -> bool:
    # torch.save writes zip archives; files in another format are left to their reader.
    with file.open("rb") as handle:
        return handle.read(4) == b"PK\x03\x04"


def check_compatible(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    problems = [
        f"{key}: checkpoint has {saved.get(key)!r}, this run has {current[key]!r}"
        for key in COMPAT_KEYS
        if key in current and _comparable(key, saved.get(key)) and saved.get(key) != current[key]
    ]
    if problems:
        raise ValueError(
            f"checkpoint {path} belongs to another setup ({'; '.join(problems)}); "
            "use a new training.output_dir or training.resume=none"
        )


def _comparable(key: str, saved_value: Any) -> bool:
    # Checkpoints written before fingerprints ignored the dtype recorded a hash of the weights as loaded,
    # which no fingerprint of today can equal; the other keys still check that the drafter fits.
    return not (key == "target_fingerprint" and is_legacy_fingerprint(saved_value))


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
    """Write the marker file last, rename into place, then prune old checkpoints.

    Only checkpoints up to this step count and may be pruned: a newer one exists only when resume
    passed over it as damaged, and counting it would prune the whole ones this run resumed from.
    """
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    up_to_now = [p for p in list_checkpoints(final.parent.parent) if p.name <= final.name]
    for old in up_to_now[:-keep_last]:
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
