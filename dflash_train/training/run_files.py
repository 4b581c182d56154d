"""Where a run's checkpoints are and what their trainer state says, with nothing heavier than the standard
library: scripts ask whether a run has finished (`dflash_train.demo.final_checkpoint`) without importing
torch or the target's code."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

CHECKPOINT_PATTERN = re.compile(r"^step-(\d{8})$")


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """The run's checkpoint folders that hold a trainer state, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if CHECKPOINT_PATTERN.match(p.name) and (p / "trainer_state.json").is_file()]
    return sorted(found, key=lambda p: p.name)


def read_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((path / "trainer_state.json").read_text())
