"""Where a checkpoint lives: a local directory or a Hugging Face Hub repo, and Hub errors as one line."""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
)

from dflash_train.errors import first_line

# What a drafter repo needs locally (plus its card); published repos may also hold images we skip.
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.py", "README.md"]
TRAINING_DRAFT_DIR = "draft"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def looks_like_hub_id(name: str) -> bool:
    return _HUB_ID.fullmatch(name) is not None and ".." not in name


def resolve_checkpoint_dir(path_or_hub_id: str | Path) -> Path:
    """A local directory (or the `draft/` folder of a training checkpoint); a Hub id (`org/name`)
    downloaded (or taken from the cache) first."""
    path = Path(path_or_hub_id).expanduser()
    if path.is_dir():
        # A training checkpoint (`checkpoints/step-N/`) keeps the drafter in its `draft/` folder.
        nested = path / TRAINING_DRAFT_DIR
        return nested if not (path / "config.json").exists() and (nested / "config.json").is_file() else path
    name = str(path_or_hub_id)
    if path.exists() or not looks_like_hub_id(name):
        raise ValueError(f"No drafter checkpoint at {name!r}: pass a checkpoint directory or a Hub id org/name")
    try:
        return Path(snapshot_download(name, allow_patterns=DOWNLOAD_PATTERNS))
    except Exception as error:  # every Hub failure becomes one line saying what to do
        raise ValueError(f"No local directory {name!r}, and fetching it from the Hugging Face Hub failed: "
                         f"{describe_hub_error(error)}") from error


def describe_hub_error(error: Exception) -> str:
    """A one-line reason and fix for a `huggingface_hub` failure."""
    if isinstance(error, OfflineModeIsEnabled):
        return "offline mode is on (HF_HUB_OFFLINE); unset it on a machine with network access"
    if isinstance(error, RepositoryNotFoundError):
        return "the repo does not exist or the token cannot see it; check the id and `hf auth login`"
    if isinstance(error, LocalEntryNotFoundError):
        why = "offline mode is on (HF_HUB_OFFLINE)" if constants.HF_HUB_OFFLINE else "the Hub is unreachable"
        return f"{why} and the repo is not in the local cache; download it where there is network access"
    if isinstance(error, HfHubHTTPError):
        status = getattr(error.response, "status_code", None)
        if status in (401, 403):
            return f"the Hub refused the request (HTTP {status}); use a token with write access to this namespace"
        return f"HTTP {status}: {first_line(error)}"
    if isinstance(error, OSError) or type(error).__module__.split(".")[0] in {"httpx", "httpx2", "requests", "urllib3"}:
        return f"cannot reach the Hub ({first_line(error)}); check the network or HF_ENDPOINT"
    return f"{type(error).__name__}: {first_line(error)}"
