"""Append-only shard directories: rank/world discovery, and the shard names of each step.

A shard is written to a temporary name in the same directory and renamed into place (``dflash_train.atomic``),
so a file with a final name is always complete: a killed run leaves at most a temporary file, which the next
run ignores and overwrites. Work is planned as numbered units from the input alone, so every rank and every resumed
run agrees on what unit ``k`` contains; rank ``r`` of ``w`` owns units ``k % w == r``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dflash_train.json_files import read_json_object, rerun_keeps_shards

REGEN_MANIFEST = "regenerate.json"
# What to do about a damaged regenerate.json: a run resumes by its finished shards, so they are kept.
REGENERATE_AGAIN = rerun_keeps_shards("regenerate")
REGEN_SHARD_GLOB = "part-*.jsonl"


def rank_and_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """Explicit values, else ``RANK``/``WORLD_SIZE`` as set by torchrun and accelerate, else (0, 1)."""
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}; pass 0 <= --rank < --world-size")
    return rank, world_size


def regenerated_shard_path(out_dir: Path, unit: int) -> Path:
    return out_dir / f"part-{unit:06d}.jsonl"


def regenerated_files(out_dir: Path) -> list[Path]:
    """Finished regeneration shards in unit order (temporary files never match the pattern)."""
    return sorted(out_dir.glob(REGEN_SHARD_GLOB))


def check_same_settings(path: Path, expected: dict[str, Any], what: str, command: str) -> None:
    """Refuse to resume into ``path``'s directory when it was started with other settings (``command``: the
    `dflash-train` command that writes it)."""
    if not path.is_file():
        return
    found = read_json_object(path, rerun_keeps_shards(command))
    changed = sorted(key for key in expected if found.get(key) != expected[key])
    if changed:
        raise ValueError(
            f"{path.parent} holds {what} made with other settings ({', '.join(changed)}); "
            f"use the same settings to resume, or another --out directory"
        )
