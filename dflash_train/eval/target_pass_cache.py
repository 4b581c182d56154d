"""The target-alone pass of an eval, kept on disk for the next drafter evaluated on the same prompts.

Evaluating many drafters of one target (an ablation's runs, a curve's checkpoints, a sweep of a user's own)
decodes the same prompts with the target alone every time: greedy, with the same engine settings on the same
device, that pass gives the same tokens, and on the same machine about the same speed. `eval --target-cache
DIR` keeps each pass (its answers and timing) in DIR under a key naming everything the pass depends on: the
target's weights, dtype and device, the engine's settings and every prompt's tokens. A later eval whose key
matches reads the pass instead of decoding it again.

Only the speed baseline and the answers it gives (the history of a later turn, the teacher-forced τ̂'s text)
come from the cache. The lossless check's own pass still runs in the eval that claims it, so exactness is
never taken from a file. A report marks each set whose baseline was read (`target_only_reused`): its speedup
then compares this process's drafter pass with another process's target pass on the same machine.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from dflash_train.atomic import write_json_atomically
from dflash_train.runtime.engine import EngineConfig, RunStats
from dflash_train.runtime.state import RequestOutput
from dflash_train.target import TargetModel
from dflash_train.target.fingerprint import target_fingerprint

logger = logging.getLogger(__name__)
FORMAT = 1


def target_identity(target: TargetModel, engine: EngineConfig) -> dict[str, Any]:
    """What a target-alone pass depends on besides its prompts: weights, dtype, device, software, settings."""
    weight = next(target.model.parameters())
    device = torch.cuda.get_device_name(weight.device) if weight.device.type == "cuda" else weight.device.type
    return {"format": FORMAT, "target": target_fingerprint(target.model), "dtype": str(weight.dtype),
            "device": device, "torch": torch.__version__, "engine": repr(engine)}


def pass_key(identity: Mapping[str, Any], prompts: Sequence[Sequence[int]]) -> str:
    payload = json.dumps({"identity": dict(identity), "prompts": [list(p) for p in prompts]}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


class TargetPassCache:
    """Target-alone passes in `directory`, one JSON file per (identity, prompts) key."""

    def __init__(self, directory: Path, identity: Mapping[str, Any]) -> None:
        self.directory, self.identity = directory, dict(identity)

    def path(self, prompts: Sequence[Sequence[int]]) -> Path:
        return self.directory / f"target-pass-{pass_key(self.identity, prompts)}.json"

    def load(self, prompts: Sequence[Sequence[int]]) -> tuple[list[RequestOutput], RunStats] | None:
        """The stored pass for these prompts, or None (none stored, or a file this cannot use: decoded again)."""
        path = self.path(prompts)
        if not path.exists():
            return None
        try:
            stored = json.loads(path.read_text())
            if stored["identity"] != self.identity or len(stored["outputs"]) != len(prompts):
                raise ValueError("it was written for other settings")
            outputs = [RequestOutput(**row) for row in stored["outputs"]]
            return outputs, RunStats(**stored["stats"])
        except (OSError, ValueError, KeyError, TypeError) as error:  # JSONDecodeError is a ValueError
            logger.warning("target cache: %s is unusable (%s); decoding the target alone again", path, error)
            return None

    def store(self, prompts: Sequence[Sequence[int]], outputs: Sequence[RequestOutput],
              stats: RunStats) -> Path | None:
        """Write the pass (whole or not at all); a write that fails (a full disk) only warns: the eval goes on."""
        path = self.path(prompts)
        try:
            write_json_atomically(path, {"identity": self.identity, "stats": asdict(stats),
                                         "outputs": [asdict(output) for output in outputs]})
        except OSError as error:
            logger.warning("target cache: could not write %s (%s); this eval goes on without it", path, error)
            return None
        return path
